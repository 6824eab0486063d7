-- budget.lua: a job's spend cap, shared by the fleet. Amounts in nano-USD.
--
-- KEYS[1]  budget hash      bf:{job}:budget: `cap`, `spent` (settled calls,
--          and reservations whose worker vanished: charged in full),
--          `reserved` (calls in flight)
-- KEYS[2]  reservations     bf:{job}:budget:held: member `id:amount`, score
--          its expiry (Unix ms, Redis's clock): a dead worker's reservation
--          is charged then
-- KEYS[3]  halt key         bf:{job}:halt
-- ARGV[1]  `reserve` or `settle`
-- reserve: ARGV[2] lease ms, then pairs (id, amount): each call is reserved
--   at its most when spent + reserved + amount stays within the cap (1).
--   Otherwise, when the calls in flight could still leave room (spent +
--   amount within the cap), it waits (2); when not even that, the job halts
--   with reason `budget` and this and every later call is refused (0).
-- settle: pairs (member, actual amount): the reservation is released and
--   the actual cost is spent (a reservation already charged as expired adds
--   only what the call cost beyond it). Returns the number settled.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local mode = ARGV[1]
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
  local lease = tonumber(ARGV[2])
  local spent, reserved = num('spent'), num('reserved')
  local halted = false
  for i = 3, #ARGV, 2 do
    local amount = tonumber(ARGV[i + 1])
    if halted then
      out[#out + 1] = 0
    elseif not cap or spent + reserved + amount <= tonumber(cap) then
      reserved = reserved + amount
      redis.call('ZADD', KEYS[2], now + lease, ARGV[i] .. ':' .. ARGV[i + 1])
      out[#out + 1] = 1
    elseif spent + amount <= tonumber(cap) then
      out[#out + 1] = 2
    else
      halted = true
      redis.call('SET', KEYS[3], string.format(
        'budget: spent %.6f USD (%.6f USD more in flight) of the job\'s %.6f USD; a call costs up to %.6f; raise it with producer resume --budget',
        spent / 1e9, reserved / 1e9, tonumber(cap) / 1e9, amount / 1e9), 'NX')
      out[#out + 1] = 0
    end
  end
  redis.call('HSET', KEYS[1], 'reserved', reserved)
  return out
end
local n = 0
for i = 2, #ARGV, 2 do
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
