-- budget.lua: a job's spend cap, shared by the fleet. Amounts in nano-USD.
--
-- KEYS[1]  budget hash      bf:{job}:budget: `cap`, `spent` (settled calls,
--          and reservations whose worker vanished: charged in full),
--          `reserved` (calls in flight)
-- KEYS[2]  reservations     bf:{job}:budget:held: member `id:amount`, score
--          its expiry (Unix ms): a dead worker's reservation is charged then
-- KEYS[3]  halt key         bf:{job}:halt
-- ARGV[1]  now (Unix ms), ARGV[2] `reserve` or `settle`
-- reserve: ARGV[3] lease ms, then pairs (id, amount): each call is reserved
--   at its most, unless spent + reserved + amount would pass the cap: then
--   it (and every later one) is refused and the job halts with reason
--   `budget`. Returns 1 or 0 per call.
-- settle: pairs (member, actual amount): the reservation is released and
--   the actual cost is spent (a reservation already charged as expired adds
--   only what the call cost beyond it). Returns the number settled.
local now, mode = tonumber(ARGV[1]), ARGV[2]
local function num(field)
  return tonumber(redis.call('HGET', KEYS[1], field) or '0')
end
-- Reservations of workers that vanished mid-call: the call may be billed.
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, m in ipairs(expired) do
  local amount = tonumber(string.match(m, ':(%d+)$')) or 0
  redis.call('HINCRBY', KEYS[1], 'reserved', -amount)
  redis.call('HINCRBY', KEYS[1], 'spent', amount)
end
if #expired > 0 then
  redis.call('ZREM', KEYS[2], unpack(expired))
end
local out = {}
if mode == 'reserve' then
  local cap = redis.call('HGET', KEYS[1], 'cap')
  local lease = tonumber(ARGV[3])
  local spent, reserved = num('spent'), num('reserved')
  local refused = false
  for i = 4, #ARGV, 2 do
    local amount = tonumber(ARGV[i + 1])
    if not refused and cap and spent + reserved + amount > tonumber(cap) then
      refused = true
      redis.call('SET', KEYS[3], string.format(
        'budget: spent %.6f USD and %.6f USD in flight of the job\'s %.6f USD; raise it with producer resume --budget',
        spent / 1e9, reserved / 1e9, tonumber(cap) / 1e9), 'NX')
    end
    if refused then
      out[#out + 1] = 0
    else
      reserved = reserved + amount
      redis.call('ZADD', KEYS[2], now + lease, ARGV[i] .. ':' .. amount)
      out[#out + 1] = 1
    end
  end
  redis.call('HSET', KEYS[1], 'reserved', reserved)
  return out
end
local n = 0
for i = 3, #ARGV, 2 do
  local member, actual = ARGV[i], tonumber(ARGV[i + 1])
  local amount = tonumber(string.match(member, ':(%d+)$')) or 0
  if redis.call('ZREM', KEYS[2], member) == 1 then
    redis.call('HINCRBY', KEYS[1], 'reserved', -amount)
    redis.call('HINCRBY', KEYS[1], 'spent', actual)
  elseif actual > amount then
    redis.call('HINCRBY', KEYS[1], 'spent', actual - amount)
  end
  n = n + 1
end
return n
