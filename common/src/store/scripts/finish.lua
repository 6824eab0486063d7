-- finish.lua: settle one delivered task and acknowledge it, atomically.
--
-- Only for the live delivery: the entry must still be pending for this
-- consumer with this delivery count (the fencing token). A worker whose task
-- was taken over meanwhile (it hung, or was stopped past the visibility
-- timeout) gets -1: nothing changes, and nothing is acknowledged, since the
-- entry now belongs to the worker that took it over.
--
-- The record's state moves only from `queued` or `delayed`; a record already
-- in a terminal state (done, review, dropped, cancelled) is left as it is, so
-- a redelivered or late task never writes a second outcome. The entry is
-- acknowledged and deleted from the stream in every case.
--
-- KEYS[1]  partition stream        bf:{job:pN}:tasks
-- KEYS[2]  partition state hash    bf:{job:pN}:state
-- KEYS[4]  partition sink stream   bf:{job:pN}:sink: when it exists (the job
--          has a sink), a record that became done (`k` r) or went to review,
--          was dropped or cancelled (`k` f) is handed to the sink through it
-- KEYS[3]  the mode's target:      commit -> bf:{job:pN}:results (hash)
--                                  retry  -> bf:{job:pN}:delayed (sorted set)
--                                  review -> bf:{job:pN}:review  (hash)
--                                  drop   -> bf:{job:pN}:state   (same as KEYS[2])
--                                  cancel -> bf:{job:pN}:cancelled (hash, for resume)
--                                  release -> bf:{job:pN}:tasks (same as KEYS[1])
-- ARGV[1]  consumer group
-- ARGV[2]  stream entry id
-- ARGV[3]  record_id
-- ARGV[4]  mode: commit | retry | review | drop | cancel | release (back to the
--          stream as a new entry, not called: a halted worker hands its tasks back)
-- ARGV[5]  commit: the encoded result; retry, cancel, release: the encoded task; review:
--          the encoded entry; drop: the reason (all passed through unread)
-- ARGV[6]  retry: due time, Unix ms (unused otherwise)
-- ARGV[7]  the consumer the entry was delivered to
-- ARGV[8]  its delivery count at that delivery
-- Returns: 1 when this call moved the record, 0 when it was already settled
--          (acknowledged only), -1 when the delivery is stale (nothing done).
local stream, states, target = KEYS[1], KEYS[2], KEYS[3]
local group, entry, rid, mode, value = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local owner = redis.call('XPENDING', stream, group, entry, entry, 1)[1]
if not owner or owner[2] ~= ARGV[7] or tonumber(owner[4]) ~= tonumber(ARGV[8]) then
  return -1
end
local state = redis.call('HGET', states, rid)
local moved = 0
if mode == 'release' then
  if state == 'queued' then
    redis.call('XADD', stream, '*', 'rid', rid, 'task', value)
    moved = 1
  end
elseif mode == 'retry' then
  -- Only a record in flight schedules a retry: one already waiting keeps its one.
  if state == 'queued' then
    redis.call('ZADD', target, ARGV[6], value)
    redis.call('HSET', states, rid, 'delayed')
    moved = 1
  end
elseif state == 'queued' or state == 'delayed' then
  if mode == 'commit' then
    if redis.call('HSETNX', target, rid, value) == 1 then
      redis.call('HSET', states, rid, 'done')
      moved = 1
    end
  elseif mode == 'review' then
    redis.call('HSET', target, rid, value)
    redis.call('HSET', states, rid, 'review')
    moved = 1
  elseif mode == 'drop' then
    redis.call('HSET', states, rid, 'dropped:' .. value)
    moved = 1
  elseif mode == 'cancel' then
    redis.call('HSET', target, rid, value)
    redis.call('HSET', states, rid, 'cancelled')
    moved = 1
  else
    return redis.error_reply('finish.lua: unknown mode ' .. tostring(mode))
  end
end
if moved == 1 and mode ~= 'retry' and mode ~= 'release' and redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('XADD', KEYS[4], '*', 'rid', rid, 'k', mode == 'commit' and 'r' or 'f')
end
redis.call('XACK', stream, group, entry)
redis.call('XDEL', stream, entry)
return moved
