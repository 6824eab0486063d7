-- limit_settle.lua: settle one grant with what really happened, atomically.
--
-- Frees the grant's concurrency slot; returns to the token buckets what was
-- reserved but not used (or takes more, when the estimate was low); learns
-- the provider's limits and remaining budget from its headers (only ever
-- tightening: `remaining` below our level lowers it); and on a 429 pauses the
-- whole fleet until the provider's retry hint.
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
local pause = tonumber(ARGV[9])
if pause > 0 then
  local until_ms = now + pause
  local cur = tonumber(redis.call('HGET', b, 'pause')) or 0
  if until_ms > cur then redis.call('HSET', b, 'pause', until_ms) end
end
return held
