-- Acknowledges a batch of a partition's sink stream once the sink holds it
-- durably, and takes the results it wrote out of Redis, with their records'
-- idempotency keys (the state entry, which lives as long as the job, keeps
-- a re-enqueue from adding them again): what stays is the record's state
-- (`done`) and origin, and the partition's `sunk` counters keep the figures
-- of what left (each result counted once: only when it is removed).
--
-- KEYS[1]  partition sink stream   bf:{job:pN}:sink
-- KEYS[2]  partition results hash  bf:{job:pN}:results
-- KEYS[3]  partition sunk counters bf:{job:pN}:sunk
-- KEYS[3+i] the idempotency key of the i-th result below  bf:{job:pN}:idem:<record_id>
-- ARGV[1]  consumer group
-- ARGV[2]  rows that were new in the sink
-- ARGV[3]  n, the number of stream entry ids that follow
-- ARGV[4 .. 3+n]  the entry ids
-- then, per result the sink holds: record_id, attempts, prompt, completion, cached tokens
-- Returns the number of results removed.
local stream, results, sunk = KEYS[1], KEYS[2], KEYS[3]
local n = tonumber(ARGV[3])
for i = 4, 3 + n do
  redis.call('XACK', stream, ARGV[1], ARGV[i])
  redis.call('XDEL', stream, ARGV[i])
end
local written = tonumber(ARGV[2])
if written > 0 then
  redis.call('HINCRBY', sunk, 'written', written)
end
local removed, k = 0, 3
for i = 4 + n, #ARGV, 5 do
  k = k + 1
  redis.call('DEL', KEYS[k])
  if redis.call('HDEL', results, ARGV[i]) == 1 then
    removed = removed + 1
    redis.call('HINCRBY', sunk, 'a' .. ARGV[i + 1], 1)
    redis.call('HINCRBY', sunk, 'prompt', ARGV[i + 2])
    redis.call('HINCRBY', sunk, 'completion', ARGV[i + 3])
    redis.call('HINCRBY', sunk, 'cached', ARGV[i + 4])
  end
end
if removed > 0 then
  redis.call('HINCRBY', sunk, 'done', removed)
end
return removed
