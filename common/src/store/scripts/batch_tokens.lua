-- batch_tokens.lua: a job's tokens enqueued at the provider in unfinished
-- batches, against the provider's limit (`[batch] max_enqueued_tokens`).
--
-- KEYS[1]  the job's hash          bf:{job}:batch_tokens: shard id -> its tokens
-- ARGV[1]  `take`: ARGV[2] shard id, ARGV[3] its tokens, ARGV[4] the limit.
--          Counted only if the batches already counted and it fit under the
--          limit (or it is the only one: a shard larger than the limit still
--          runs, alone). Returns 1 when counted (or already), else 0.
--          `give`: ARGV[2] shard id: its batch ended. Returns 1.
local key = KEYS[1]
if ARGV[1] == 'give' then
  redis.call('HDEL', key, ARGV[2])
  return 1
end
if redis.call('HGET', key, ARGV[2]) then
  return 1
end
local total = 0
local all = redis.call('HGETALL', key)
for i = 2, #all, 2 do
  total = total + tonumber(all[i])
end
local tokens, limit = tonumber(ARGV[3]), tonumber(ARGV[4])
if total > 0 and total + tokens > limit then
  return 0
end
redis.call('HSET', key, ARGV[2], ARGV[3])
return 1
