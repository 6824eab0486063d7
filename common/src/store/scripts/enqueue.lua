-- enqueue.lua: add a batch of records of ONE partition, each exactly once.
--
-- For each record: take its idempotency key with SET NX EX; when taken, also
-- claim its entry in the state hash (HSETNX, which outlives the key's TTL) and,
-- for a task, XADD it to the partition stream. A record already known adds
-- nothing. All in one atomic step, over keys of one hash tag.
--
-- KEYS[1]      partition stream            bf:{job:pN}:tasks
-- KEYS[2]      partition state hash        bf:{job:pN}:state
-- KEYS[2+i]    idempotency key of record i bf:{job:pN}:idem:<record_id>
-- ARGV[1]      idempotency key TTL, seconds
-- ARGV[1+5(i-1)+1..5] for record i:
--              record_id, origin ("<dataset sha12>:<line>"),
--              state ("queued" for a task, "dropped:<reason>" for an input error),
--              business key, input JSON
-- Returns: an array with, per record i, integer 1 when it was added, else the
--          origin stored by the run that added it ("" when its key had expired).
local ttl = ARGV[1]
local n = #KEYS - 2
local out = {}
for i = 1, n do
  local b = 1 + (i - 1) * 5
  local rid, origin, state, key, input = ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], ARGV[b + 4], ARGV[b + 5]
  if redis.call('SET', KEYS[2 + i], origin, 'NX', 'EX', ttl) then
    if redis.call('HSETNX', KEYS[2], rid, state) == 1 then
      if state == 'queued' then
        redis.call('XADD', KEYS[1], '*', 'rid', rid, 'key', key, 'origin', origin, 'input', input)
      end
      out[i] = 1
    else
      out[i] = ''
    end
  else
    out[i] = redis.call('GET', KEYS[2 + i])
  end
end
return out
