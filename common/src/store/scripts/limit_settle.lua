-- limit_settle.lua: settle one grant with what really happened, atomically.
--
-- Frees the grant's concurrency slot; returns to the token buckets what was
-- reserved but not used (or takes more, when the estimate was low); learns
-- the provider's limits and remaining budget from its headers (only ever
-- tightening: `remaining` below our level lowers it); and on a 429 pauses the
-- whole fleet until the provider's retry hint.
--
-- The adaptive controller (AIMD, shared by the fleet): a bare 429 (no retry
-- hint: a hinted one only pauses the fleet as long as it says) cuts the
-- learned request rate `ar` to 0.7 of what the fleet was sending and the
-- learned concurrency `ac` to 0.7 of what was in flight, once per congestion
-- event (a 429 on a grant taken before the last cut does not cut again;
-- `dseq` is the grant sequence at the cut) and only from the second bare 429
-- within 10 s (`bn` of them since `bt`: one alone is noise, not a limit);
-- every answer while a learned limit is what
-- holds the fleet back (`rb`/`cb` fresh) raises it a little: the rate by half
-- a request a minute, the concurrency by 1/ac. A learned limit that reaches
-- the spec's ceiling is dropped (the spec's own limit applies).
--
-- KEYS[1]  bucket hash       bf:{rl:ID}:buckets
-- KEYS[2]  in-flight zset    bf:{rl:ID}:inflight
-- ARGV[1]  grant id (prefix:seq:reserved_tokens; the reserved tokens are
--          added to the `settled` counter)
-- ARGV[2..4]  reserved minus used: total, input, output tokens (may be negative)
-- ARGV[5]  header limit of requests/min (-1 = unknown)
-- ARGV[6]  header limit of tokens/min (-1 = unknown)
-- ARGV[7]  header remaining requests (-1 = unknown)
-- ARGV[8]  header remaining tokens (-1 = unknown)
-- ARGV[9]  pause the fleet for this many ms (0 = no pause)
-- ARGV[10] what the call did: `ok` (answered), `limited` (bare 429),
--          `hinted` (429 with a retry hint), `timeout`
--          (no answer in time; the server may still be working on it), or
--          `other`
-- ARGV[11] after a timeout, keep the concurrency slot this many ms more
-- ARGV[12] the spec's requests/min ceiling (0 = none)
-- ARGV[13] the spec's concurrency ceiling (0 = none)
-- Returns: 1 if the grant was still held, 0 if it had expired or was settled already.
local b, inflight = KEYS[1], KEYS[2]
local held = redis.call('ZREM', inflight, ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function add(field, delta)
  local v = tonumber(redis.call('HGET', b, field))
  if v ~= nil and delta ~= 0 then
    redis.call('HSET', b, field, tostring(v + delta))
  end
end
if held == 1 then
  redis.call('HINCRBY', b, 'settled', tonumber(string.match(ARGV[1], ':(%d+)$')) or 0)
  add('t', tonumber(ARGV[2]))
  add('i', tonumber(ARGV[3]))
  add('o', tonumber(ARGV[4]))
end
local hr, ht = tonumber(ARGV[5]), tonumber(ARGV[6])
if hr > 0 or ht > 0 then
  if hr > 0 then redis.call('HSET', b, 'hr', hr) end
  if ht > 0 then redis.call('HSET', b, 'ht', ht) end
  redis.call('HSET', b, 'hat', now)
end
local rr, rt = tonumber(ARGV[7]), tonumber(ARGV[8])
if rr >= 0 then
  local v = tonumber(redis.call('HGET', b, 'r'))
  if v ~= nil and rr < v then redis.call('HSET', b, 'r', rr) end
end
if rt >= 0 then
  local v = tonumber(redis.call('HGET', b, 't'))
  if v ~= nil and rt < v then redis.call('HSET', b, 't', rt) end
end
local kind = ARGV[10]
if held == 1 and kind == 'timeout' and tonumber(ARGV[11]) > 0 then
  -- Its tokens are settled above; the slot stays taken (0 tokens at expiry).
  redis.call('ZADD', inflight, now + tonumber(ARGV[11]), ARGV[1] .. ':grace:0')
end
if kind == 'limited' then
  local seq = tonumber(string.match(ARGV[1], ':(%d+):%d+$')) or 0
  local a = redis.call('HMGET', b, 'dseq', 'ar', 'ac', 'wn', 'ws', 'pr', 'seq', 'bn', 'bt')
  local fresh = seq > (tonumber(a[1]) or 0)
  local bn, bt = tonumber(a[8]) or 0, tonumber(a[9]) or now
  -- Only 429s on grants taken after the last cut count towards the next one.
  if fresh then
    bn = bn + 1
    if now - bt > 10000 then bn, bt = 1, now end
    redis.call('HSET', b, 'bn', bn, 'bt', bt)
  end
  if bn >= 2 and fresh then
    local ws = tonumber(a[5]) or now
    local sending = math.max(tonumber(a[6]) or 0, (tonumber(a[4]) or 0) * 60000 / math.max(now - ws, 1000))
    local ar = tonumber(a[2])
    -- The cut is from what the fleet was sending, never below half the
    -- learned rate at once (a window that included a pause reads low).
    if ar == nil then ar = sending elseif sending < ar then ar = math.max(sending, ar * 0.5 / 0.7) end
    local n = redis.call('ZCARD', inflight) + held
    local ac = tonumber(a[3])
    if ac == nil or n < ac then ac = n end
    -- The request bucket restarts empty: no burst into a provider just refused.
    redis.call('HSET', b, 'dseq', a[7] or 0, 'ar', tostring(math.max(1, ar * 0.7)),
      'ac', tostring(math.max(1, ac * 0.7)), 'r', 0, 'bn', 0)
  end
elseif kind == 'ok' then
  local a = redis.call('HMGET', b, 'ar', 'rb', 'ac', 'cb')
  local ar, ac = tonumber(a[1]), tonumber(a[3])
  local ceil_r, ceil_c = tonumber(ARGV[12]), tonumber(ARGV[13])
  if ar and now - (tonumber(a[2]) or 0) < 5000 then
    ar = ar + 0.5
    if ceil_r > 0 and ar >= ceil_r then redis.call('HDEL', b, 'ar') else redis.call('HSET', b, 'ar', tostring(ar)) end
  end
  if ac and now - (tonumber(a[4]) or 0) < 5000 then
    ac = ac + 1 / ac
    if ceil_c > 0 and ac >= ceil_c then redis.call('HDEL', b, 'ac') else redis.call('HSET', b, 'ac', tostring(ac)) end
  end
end
local pause = tonumber(ARGV[9])
if pause > 0 then
  local until_ms = now + pause
  local cur = tonumber(redis.call('HGET', b, 'pause')) or 0
  if until_ms > cur then redis.call('HSET', b, 'pause', until_ms) end
end
return held
