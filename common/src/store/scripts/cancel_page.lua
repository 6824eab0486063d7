-- cancel_page.lua: cancel one page of a partition's not-yet-running work.
--
-- Tasks never delivered to a worker (after the group's last-delivered id) and
-- tasks waiting to retry are moved to the cancelled hash (kept for resume) and
-- their records marked `cancelled`. Delivered tasks are left to their worker:
-- in-flight work finishes. Called repeatedly until it returns 0.
--
-- KEYS[1]  partition stream          bf:{job:pN}:tasks
-- KEYS[2]  partition state hash      bf:{job:pN}:state
-- KEYS[3]  partition delayed set     bf:{job:pN}:delayed
-- KEYS[4]  partition cancelled hash  bf:{job:pN}:cancelled
-- KEYS[5]  partition sink stream      bf:{job:pN}:sink (see finish.lua): a
--          cancelled record is handed to the sink as a failure (`k` f)
-- ARGV[1]  consumer group
-- ARGV[2]  at most this many tasks per call
-- Delayed members and stream entries' `task` field are encoded tasks, kept
-- unread; read: a delayed member's record id (always first: `{"rid":"<id>",...`).
-- Entries of versions before the one encoding (one field per item) are
-- encoded here with the same field names.
-- Returns: the number of records cancelled by this call.
local stream, states, delayed, cancelled = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local limit = tonumber(ARGV[2])
local n = 0
local sink = redis.call('EXISTS', KEYS[5]) == 1
local function cancel(rid, task)
  if redis.call('HGET', states, rid) == 'queued' or redis.call('HGET', states, rid) == 'delayed' then
    redis.call('HSET', cancelled, rid, task)
    redis.call('HSET', states, rid, 'cancelled')
    if sink then redis.call('XADD', KEYS[5], '*', 'rid', rid, 'k', 'f') end
    n = n + 1
  end
end
-- Waiting retries.
for _, member in ipairs(redis.call('ZRANGE', delayed, 0, limit - 1)) do
  local rid = string.match(member, '^{"rid":"([^"]*)"')
  if rid then cancel(rid, member) end
  redis.call('ZREM', delayed, member)
end
-- Undelivered tasks: after the group's last-delivered id.
local last = '0-0'
for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  if info['name'] == ARGV[1] then last = info['last-delivered-id'] end
end
local entries = redis.call('XRANGE', stream, '(' .. last, '+', 'COUNT', limit)
for _, e in ipairs(entries) do
  local f = {}
  for i = 1, #e[2], 2 do f[e[2][i]] = e[2][i + 1] end
  local task = f['task']
  if not task then
    task = cjson.encode({rid = f['rid'], input = f['input'], attempt = tonumber(f['attempt'] or '0'),
      calls = tonumber(f['calls'] or '0'), base = tonumber(f['base'] or '0'), feedback = f['feedback'] or '[]',
      history = f['history'] or '[]', tp = f['tp']})
  end
  cancel(f['rid'], task)
  redis.call('XDEL', stream, e[1])
end
return n
