-- resume_page.lua: put one page of a partition's cancelled records back on
-- its stream, with their attempt counts and history.
--
-- KEYS[1]  partition stream          bf:{job:pN}:tasks
-- KEYS[2]  partition state hash      bf:{job:pN}:state
-- KEYS[3]  partition cancelled hash  bf:{job:pN}:cancelled
-- ARGV[1]  at most this many records per call
-- Values of the cancelled hash are encoded tasks, passed through unread.
-- Returns: the number of records re-queued by this call.
local stream, states, cancelled = KEYS[1], KEYS[2], KEYS[3]
local page = redis.call('HSCAN', cancelled, 0, 'COUNT', tonumber(ARGV[1]))
local n = 0
local items = page[2]
for i = 1, #items, 2 do
  local rid, task = items[i], items[i + 1]
  if redis.call('HGET', states, rid) == 'cancelled' then
    redis.call('XADD', stream, '*', 'rid', rid, 'task', task)
    redis.call('HSET', states, rid, 'queued')
    n = n + 1
  end
  redis.call('HDEL', cancelled, rid)
end
return n
