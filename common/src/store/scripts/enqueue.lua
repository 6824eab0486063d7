-- enqueue.lua: add a batch of records of ONE partition, each exactly once.
--
-- A record is known to the job when it has an entry in the partition's state
-- hash (which lives as long as the job). For each record not known yet: take
-- its idempotency key with SET NX EX, XADD the task (or, for an input error,
-- only record it as dropped), and claim its state entry. A record already
-- known, or whose key is taken (the same id earlier in this batch), adds
-- nothing. All in one atomic step, over keys of one hash tag.
--
-- KEYS[1]      partition stream            bf:{job:pN}:tasks
-- KEYS[2]      partition state hash        bf:{job:pN}:state
-- KEYS[3]      partition origins hash      bf:{job:pN}:origin (record -> origin, no TTL)
-- KEYS[4]      partition sink stream       bf:{job:pN}:sink: when it exists (the job
--              has a sink), a record dropped for an input error is handed to it
--              as a failure (`k` f), like every other outcome
-- KEYS[4+i]    idempotency key of record i bf:{job:pN}:idem:<record_id>
-- ARGV[1]      idempotency key TTL, seconds
-- ARGV[1+4(i-1)+1..4] for record i (at most 1000 records a call):
--              record_id, origin ("<dataset sha12>:<line>"),
--              state ("queued" for a task, "dropped:<reason>" for an input error),
--              the encoded task without its record id ("" for a dropped record),
--              passed through as it is
-- A task entry holds `rid` (for scans, and the task's record id) and `task`
-- (the encoded task, which this script never reads); the business key is
-- inside the input, and the origin stays in the origins hash and the
-- idempotency key (small entries enqueue faster).
-- Returns: an array with, per record i, integer 1 when it was added, else the
--          origin stored by the run that added it (from its state entry once
--          its result is in the sink, else the origins hash, or
--          for jobs enqueued before it existed the idempotency key; "" when
--          neither holds it).
local call = redis.call
local stream, states, origins, sink, ttl = KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1]
local n = #KEYS - 4
local to_sink = call('EXISTS', sink) == 1
local ids = {}
for i = 1, n do
  ids[i] = ARGV[(i - 1) * 4 + 2]
end
-- One read for the whole batch: which records the job already holds.
local known = call('HMGET', states, unpack(ids))
local out, claimed, placed = {}, {}, {}
for i = 1, n do
  local b = (i - 1) * 4
  local idem, origin, state = KEYS[4 + i], ARGV[b + 3], ARGV[b + 4]
  if known[i] then
    -- A record whose result is in the sink keeps its origin in its state entry.
    local sunk = string.match(known[i], '^d@(.*)$') or string.match(known[i], '^done@(.*)$')
    out[i] = sunk or call('HGET', origins, ids[i]) or call('GET', idem) or ''
  elseif call('SET', idem, origin, 'NX', 'EX', ttl) then
    if state == 'queued' then
      call('XADD', stream, '*', 'rid', ids[i], 'task', ARGV[b + 5])
    elseif to_sink then
      call('XADD', sink, '*', 'rid', ids[i], 'k', 'f')
    end
    claimed[#claimed + 1] = ids[i]
    claimed[#claimed + 1] = state
    placed[#placed + 1] = ids[i]
    placed[#placed + 1] = origin
    out[i] = 1
  else
    -- Taken but not yet in the state hash: the same id earlier in this batch.
    out[i] = call('GET', idem)
  end
end
if #claimed > 0 then
  call('HSET', states, unpack(claimed))
  call('HSET', origins, unpack(placed))
end
return out
