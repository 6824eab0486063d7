-- renew.lua: a delivery its worker keeps for a later call (its failed
-- probe's, for the next probe while the provider is down) is made fresh
-- again: its idle time starts over (`XCLAIM ... JUSTID`: the delivery count
-- is unchanged), so no rescuer takes it over while that call is out; only
-- while it is still the live delivery (pending for its consumer with its
-- delivery count: the fencing token).
--
-- KEYS[1]  partition stream       bf:{job:pN}:tasks
-- KEYS[2]  partition state hash   bf:{job:pN}:state
-- ARGV[1]  consumer group
-- ARGV[2]  stream entry id
-- ARGV[3]  the consumer it was delivered to
-- ARGV[4]  its delivery count at that delivery
-- ARGV[5]  record id
-- Returns false (nil) when the delivery is no longer the live one (another
-- worker took it over; nothing changes), else the record's state ('' when
-- the job does not know the record).
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)[1]
if not p or p[2] ~= ARGV[3] or tonumber(p[4]) ~= tonumber(ARGV[4]) then
  return false
end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[2], 'JUSTID')
return redis.call('HGET', KEYS[2], ARGV[5]) or ''
