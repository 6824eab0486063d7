-- limit_free.lua: the prelude of the limiter's scripts (limit_acquire.lua,
-- limit_settle.lua); it is put before each of them as it is loaded.
--
-- While nothing limits a provider key, its workers take grants on free
-- passes that Redis does not count one by one (see limit_acquire.lua).
-- Each limiter of a worker tells how many it took (the fleet's sending
-- rate counts them) and how many are in flight, kept in KEYS[3]
-- (bf:{rl:ID}:free: field, the limiter's grant id prefix; value,
-- count:expiry ms), the concurrency a cut of the learned limit starts from.
--
-- free_told(field, taken, in_flight, now, lease, add_sent): applies one
-- limiter's word: `taken` through add_sent(n); `in_flight` kept until the
-- slot lease (>0), forgotten (0), or left as it is (-1).
--
-- free_in_flight(now): the free grants in flight by every limiter's last
-- word while it holds; the expired words are dropped.
local function free_told(field, taken, in_flight, now, lease, add_sent)
  if taken > 0 then add_sent(taken) end
  if in_flight > 0 then
    redis.call('HSET', KEYS[3], field, in_flight .. ':' .. (now + lease))
    if lease > 0 then redis.call('EXPIRE', KEYS[3], math.ceil(lease / 1000)) end
  elseif in_flight == 0 then
    redis.call('HDEL', KEYS[3], field)
  end
end

local function free_in_flight(now)
  local n, all, gone = 0, redis.call('HGETALL', KEYS[3]), {}
  for k = 1, #all, 2 do
    local count, expiry = string.match(all[k + 1], '^(%d+):(%d+)$')
    if count and tonumber(expiry) > now then
      n = n + tonumber(count)
    else
      gone[#gone + 1] = all[k]
    end
  end
  if #gone > 0 then redis.call('HDEL', KEYS[3], unpack(gone)) end
  return n
end
