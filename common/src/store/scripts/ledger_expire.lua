-- ledger_expire.lua: a partition's ledger left to expire once the sink
-- holds every call in it. A live sink writer trims the calls whose hold is
-- over (sink_ack.lua); a drained fleet never comes back to do it, so its
-- last writer leaves the ledger hash and its sunk set to expire when the
-- last call's hold ends. A call recorded later makes both persist again
-- (finish.lua, ledger.lua).
--
-- KEYS[1]  partition ledger hash   bf:{job:pN}:paid
-- KEYS[2]  its calls in the sink   bf:{job:pN}:paid:sunk (scored by when they may leave)
--
-- Returns the seconds until they expire; 0 when the ledger is empty, -1
-- when it holds calls the sink does not hold yet (nothing changed).
local n = redis.call('HLEN', KEYS[1])
if n == 0 then
  return 0
end
if redis.call('ZCARD', KEYS[2]) ~= n then
  return -1
end
local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local secs = math.max(1, math.ceil((tonumber(last[2]) - now) / 1000))
redis.call('EXPIRE', KEYS[1], secs)
redis.call('EXPIRE', KEYS[2], secs)
return secs
