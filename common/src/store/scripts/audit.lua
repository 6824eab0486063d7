-- audit.lua: the spot checks of a partition, atomically: sample committed
-- records into the audit queue, or record a person's verdict on one.
--
-- KEYS[1]  partition audit queue    bf:{job:pN}:audit: record id -> its input
--          as sampled ('' when its result carries it)
-- KEYS[2]  partition verdicts       bf:{job:pN}:audited: record id -> verdict
-- KEYS[3]  partition state hash     bf:{job:pN}:state
-- ARGV[1]  `sample`: then pairs of record id and input; a record joins the
--          queue only when it is done (`done`, or `d@<origin>` once its result
--          left for the sink), not waiting and not judged already.
--          Returns the number that joined.
-- ARGV[1]  `judge`: ARGV[2] record id, ARGV[3] the encoded verdict (passed
--          through unread); recorded only while the record waits in the
--          queue (nobody judged it meanwhile). Returns 1 when recorded, else 0.
local queue, verdicts, states = KEYS[1], KEYS[2], KEYS[3]
if ARGV[1] == 'judge' then
  if redis.call('HDEL', queue, ARGV[2]) == 0 then
    return 0
  end
  redis.call('HSET', verdicts, ARGV[2], ARGV[3])
  return 1
end
if ARGV[1] ~= 'sample' then
  return redis.error_reply('audit.lua: unknown verb ' .. tostring(ARGV[1]))
end
local added = 0
for i = 2, #ARGV, 2 do
  local rid = ARGV[i]
  local st = redis.call('HGET', states, rid)
  local done = st == 'done' or (st and string.sub(st, 1, 2) == 'd@')
  if done and not redis.call('HGET', verdicts, rid) and redis.call('HSETNX', queue, rid, ARGV[i + 1]) == 1 then
    added = added + 1
  end
end
return added
