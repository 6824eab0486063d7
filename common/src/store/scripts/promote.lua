-- promote.lua: move due retries from the delayed set back to the stream.
--
-- A member whose record is no longer `delayed` (a late commit won meanwhile)
-- is removed without being re-queued.
--
-- KEYS[1]  partition stream        bf:{job:pN}:tasks
-- KEYS[2]  partition state hash    bf:{job:pN}:state
-- KEYS[3]  partition delayed set   bf:{job:pN}:delayed
-- ARGV[1]  now, Unix ms
-- ARGV[2]  at most this many members
-- Members are task JSON objects: {"rid", "input", "attempt", "calls", "base", "feedback", "history", "tp"?}.
-- Returns: the number of tasks put back on the stream.
local stream, states, delayed = KEYS[1], KEYS[2], KEYS[3]
local due = redis.call('ZRANGEBYSCORE', delayed, '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
local moved = 0
for _, member in ipairs(due) do
  local task = cjson.decode(member)
  if redis.call('HGET', states, task.rid) == 'delayed' then
    redis.call('XADD', stream, '*', 'rid', task.rid, 'input', task.input,
      'attempt', tostring(task.attempt), 'calls', tostring(task.calls), 'base', tostring(task.base or 0),
      'feedback', task.feedback, 'history', task.history, 'tp', task.tp or '')
    redis.call('HSET', states, task.rid, 'queued')
    moved = moved + 1
  end
  redis.call('ZREM', delayed, member)
end
return moved
