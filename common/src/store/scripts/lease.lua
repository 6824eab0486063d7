-- lease.lua: take, renew or give back a lease: a worker's on its consumer
-- name, or a reviewer's on a review entry.
--
-- Two live workers must never share a consumer name (each would re-run the
-- other's pending tasks). A worker holds `bf:{consumers}:<name>` with a token
-- of its own, renewed well within the lease's lifetime; a dead worker's
-- lease expires by itself. Two reviewers must never be handed the same
-- review entry: `review next` and the console hold `bf:{job:p}:rlease:<rid>`
-- in the reviewer's name while it is on their screen.
--
-- KEYS[1]  the lease key   bf:{consumers}:<name> | bf:{job:p}:rlease:<rid>
-- ARGV[1]  the holder's token (a worker's token, a reviewer's name)
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
