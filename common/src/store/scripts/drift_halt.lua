-- drift_halt.lua: halts a job on one worker's quality drift alarm, unless
-- the job was resumed since that worker's drift watch began: its rates are
-- then from before the resume, and a person already said to go on.
--
-- KEYS[1]  the halt flag     bf:{job}:halt (first reason wins)
-- KEYS[2]  the resume mark   bf:{job}:resumed (changes at every resume)
-- ARGV[1]  the reason
-- ARGV[2]  the resume mark the worker's watch began under ('' before any)
--
-- Returns 1 when the job is halted (now, or already), 0 when the alarm is
-- older than the latest resume (nothing changed).
local mark = redis.call('GET', KEYS[2]) or ''
if mark ~= ARGV[2] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return 1
