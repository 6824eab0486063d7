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
-- Members are encoded tasks, passed through to the stream as they are. Read:
-- only the record id, which an encoded task always holds first
-- (`{"rid":"<id>",...`).
-- Returns: {the number of tasks put back on the stream, when the next retry
-- still waiting is due (Unix ms; -1 when none waits)}.
local stream, states, delayed = KEYS[1], KEYS[2], KEYS[3]
-- The earliest first: with none waiting or none due (an idle or waiting
-- fleet's every call), one command is all it costs.
local first = redis.call('ZRANGE', delayed, 0, 0, 'WITHSCORES')[2]
if not first then
  return {0, -1}
end
if tonumber(first) > tonumber(ARGV[1]) then
  return {0, tonumber(first)}
end
local due = redis.call('ZRANGEBYSCORE', delayed, '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
local moved = 0
for _, member in ipairs(due) do
  local rid = string.match(member, '^{"rid":"([^"]*)"')
  if rid and redis.call('HGET', states, rid) == 'delayed' then
    redis.call('XADD', stream, '*', 'rid', rid, 'task', member)
    redis.call('HSET', states, rid, 'queued')
    moved = moved + 1
  end
  redis.call('ZREM', delayed, member)
end
-- When the next retry is due (-1: none waits), so the promoter can sleep until then.
local next_due = redis.call('ZRANGE', delayed, 0, 0, 'WITHSCORES')[2]
return {moved, tonumber(next_due) or -1}
