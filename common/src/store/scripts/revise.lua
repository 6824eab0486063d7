-- Replaces a done record's result with a person's revision of it, only if
-- the result is still the one the reviewer read (first writer wins between
-- two reviewers; the loser reads it again). The revision itself (the output
-- it replaced kept in the result's `revisions`) is built by the caller.
--
-- KEYS[1]  partition state hash    bf:{job:pN}:state
-- KEYS[2]  partition results hash  bf:{job:pN}:results
-- ARGV[1]  record id
-- ARGV[2]  the result as read (its encoding)
-- ARGV[3]  the revised result (its encoding)
-- Returns 1 when revised, 0 when the result changed meanwhile, -1 when the
-- record is not done with its result in Redis.
local state, results = KEYS[1], KEYS[2]
local rid = ARGV[1]
if redis.call('HGET', state, rid) ~= 'done' then
  return -1
end
local now = redis.call('HGET', results, rid)
if not now then
  return -1
end
if now ~= ARGV[2] then
  return 0
end
redis.call('HSET', results, rid, ARGV[3])
return 1
