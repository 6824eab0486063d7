-- lease.lua: take, renew or give back a worker's lease on its consumer name.
--
-- Two live workers must never share a consumer name (each would re-run the
-- other's pending tasks). A worker holds `bf:{consumers}:<name>` with a token
-- of its own, renewed well within the lease's lifetime; a dead worker's
-- lease expires by itself.
--
-- KEYS[1]  the consumer's lease key   bf:{consumers}:<name>
-- ARGV[1]  this worker's token
-- ARGV[2]  take | release
-- ARGV[3]  take: the lease's lifetime, ms
-- Returns: 1 when the lease is (still, or now) this worker's, or was given
--          back; 0 when another worker holds it.
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then
  return 0
end
if ARGV[2] == 'release' then
  if held then redis.call('DEL', KEYS[1]) end
  return 1
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
