-- limit_acquire.lua: take up to N request grants from the fleet-wide budget of
-- one provider key/model, atomically, for every worker of the fleet.
--
-- Buckets refill continuously at their per-minute limit and hold at most
-- `burst_ms` worth of it. A grant takes 1 request, the request's estimated
-- total tokens (prompt + max_tokens), its input and output estimates, and one
-- concurrency slot (a member of the in-flight set that expires, so a dead
-- worker's slots come back by themselves). Limits learned from the provider's
-- headers tighten the spec's while fresh; a 429 pauses the whole fleet.
-- Limits learned from 429s (`ar` requests/min, `ac` requests in flight; see
-- limit_settle.lua) tighten them too: with no limit in the spec and none in
-- the headers, they are the only ones.
-- The clock is the server's (TIME), the same for every worker.
--
-- KEYS[1]  bucket hash       bf:{rl:ID}:buckets
--          fields: r t i o (levels), at (last refill ms), pause (ms),
--                  hr ht (header limits), hat (when they were seen, ms),
--                  ar ac (limits learned from 429s), rb cb (when each last
--                  bound, ms), wn ws pr (grants since ws, ms; the rate of
--                  the window before, per minute), cw (since when a
--                  worker waits for a concurrency slot, ms), sw (when a
--                  freed slot last woke the waiting workers, ms), qt (when
--                  the last worker the rate held back was told to come, ms)
-- KEYS[2]  in-flight zset    bf:{rl:ID}:slots  (member grant id, score minus its
--          expiry ms: the newest grant goes to the head of a small set, where
--          inserting it parses no score, and the expired are at the tail)
-- ARGV[1..4]  limits per minute: requests, total tokens, input tokens, output tokens (0 = none)
-- ARGV[5]  max concurrent requests (0 = none)
-- ARGV[6..8]  per grant: total tokens, input tokens, output tokens
-- ARGV[9]  grants wanted (N >= 1)
-- ARGV[10] burst window, ms
-- ARGV[11] slot lease, ms (a slot not settled by then is freed)
-- ARGV[12] grant id prefix (unique per worker); ids are prefix:seq:reserved_tokens
-- ARGV[13] how far ahead a grant may be scheduled, ms: a grant the buckets
--          cannot give yet is given when they will within this time, with
--          that delay (its holder waits it out before the call); the buckets
--          then run below zero, and the next grants wait behind it. One
--          acquire takes a whole stretch of the budget instead of one grant
--          each time the buckets refill.
-- ARGV[14] how long a free pass may last, ms (0 = none wanted): when nothing
--          limits the key (no limit in the spec, none from the headers while
--          fresh, none learned, no pause), no grant is counted at all: the
--          worker takes its grants by itself until then (or a 429 of its
--          own, or its settlement's news), and says how many at its next acquire
-- ARGV[15] grants this limiter took on its free passes since it last said
--          (they count in the fleet's sending rate, `wn`)
-- ARGV[16] its free grants in flight now (-1: none, and none since it last
--          said): see limit_free.lua, the prelude
-- KEYS[3]  free grants in flight  bf:{rl:ID}:free (see limit_free.lua); under
--          a learned concurrency they count with the slots
-- Counters in the bucket hash: `reserved` (tokens of every grant) and
-- `settled` (tokens of grants settled, released or expired); their difference
-- is what grants in flight hold, and 0 when the fleet is idle.
-- Returns: {granted, wait_ms, bound, id1, ..., idN, delay1, ..., delayN}, or
-- for a free pass {0, 0, 3, pass_ms, seq} (its grants' ids are prefix:seq:0):
-- wait_ms says when to ask again when granted < N; bound is 1 when the
-- rate buckets (or a pause) held back the rest (asking sooner gets nothing),
-- 2 when the concurrency slots did (a settlement that frees one wakes the
-- waiting workers), else 0; delay_k is how long grant k waits before its call.
local b, inflight = KEYS[1], KEYS[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local want = tonumber(ARGV[9])
local burst, ahead = tonumber(ARGV[10]), tonumber(ARGV[13])
local s = redis.call('HMGET', b, 'r', 't', 'i', 'o', 'at', 'pause', 'hr', 'ht', 'hat', 'ar', 'ac', 'wn', 'ws', 'qt',
  'seq', 'reserved', 'settled')
-- The fleet's sending rate, in windows of 5 s or more (what a 429 cuts):
-- `sent(n)` counts n more grants and adds the fields to write to `fields`.
local wn, ws = tonumber(s[12]) or 0, tonumber(s[13]) or now
local function sent(n, fields)
  wn = wn + n
  if now - ws >= 15000 then
    -- Far longer than a window: the fleet was idle or paused, and that time
    -- is no sending rate. Start over.
    wn, ws = n, now
  elseif now - ws >= 5000 then
    fields[#fields + 1] = 'pr'
    fields[#fields + 1] = tostring(wn * 60000 / (now - ws))
    wn, ws = 0, now
  end
  fields[#fields + 1] = 'wn'
  fields[#fields + 1] = wn
  fields[#fields + 1] = 'ws'
  fields[#fields + 1] = ws
end
-- What this limiter's free passes took and still have in flight, told first
-- (whatever this acquire answers): what they took goes into the rate
-- window, its fields in `told`, written with the hash whichever way this
-- acquire ends.
local lease = tonumber(ARGV[11])
local told = {}
free_told(ARGV[12], tonumber(ARGV[15]) or 0, tonumber(ARGV[16]) or -1, now, lease, function(n)
  sent(n, told)
end)
-- `told` and then `more` written to the hash in one HSET (`more` taken).
local function write(more)
  for _, v in ipairs(more) do told[#told + 1] = v end
  if #told > 0 then redis.call('HSET', b, unpack(told)) end
end
local pause = tonumber(s[6]) or 0
if now < pause then
  write({})
  return {0, pause - now, 1}
end
-- Header limits are trusted for a minute after they were last seen.
local fresh = (tonumber(s[9]) or 0) > now - 60000
local limits = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])}
if fresh then
  local hr, ht = tonumber(s[7]), tonumber(s[8])
  if hr and hr > 0 and (limits[1] == 0 or hr < limits[1]) then limits[1] = hr end
  if ht and ht > 0 and (limits[2] == 0 or ht < limits[2]) then limits[2] = ht end
end
-- The learned request rate, when it is the tightest: `rb` then says it bound.
local ar = tonumber(s[10])
local learned_rate = false
if ar and (limits[1] == 0 or ar < limits[1]) then
  limits[1] = ar
  learned_rate = true
  -- A rate learned from 429s is probed, not known: grants go out as the
  -- buckets give them, none ahead (given ahead, they still went out after
  -- a 429 had cut the rate, and the fleet settled lower).
  ahead = 0
end
local need = {1, tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])}
local names = {'r', 't', 'i', 'o'}
local at = tonumber(s[5]) or now
local level, cap = {}, {}
for k = 1, 4 do
  if limits[k] > 0 then
    cap[k] = math.max(limits[k] * burst / 60000, need[k], 1)
    local l = tonumber(s[k])
    if l == nil then l = cap[k] end
    level[k] = math.min(cap[k], l + (now - at) * limits[k] / 60000)
  end
end
-- How long the next grant would wait for the buckets (0: it may go now),
-- marking in `bound` each bucket that makes it wait.
local bound = {}
local function delay_of_next()
  local d = 0
  for k = 1, 4 do
    if limits[k] > 0 then
      local short = math.min(need[k], cap[k]) - level[k]
      if short > 0 then
        bound[k] = true
        d = math.max(d, math.ceil(short * 60000 / limits[k]))
      end
    end
  end
  return d
end
-- When a worker the rate holds back may come again: once half the window
-- is free (it then takes a stretch of grants, not one), and half a window
-- after the last worker told so (`qt`), so the waiting workers come one at
-- a time instead of all at the same moment: the asks per call stay the
-- same whatever the number of workers. A turn is never more than 8 half
-- windows past the time the buckets name (turns told to workers that did
-- not come back must not hold the others off).
local half = math.floor(ahead / 2)
local function come_back(d)
  local at = now + d - ahead + half
  local q = tonumber(s[14])
  if q and q + half > at then at = math.min(q + half, at + 8 * half) end
  return at
end
-- Nothing to give within the window: said at once, the levels untouched
-- (they follow from `at`), with the turn to come back.
local first = delay_of_next()
if first > ahead then
  local at = come_back(first)
  if bound[1] and learned_rate then
    write({'qt', at, 'rb', now})
  else
    write({'qt', at})
  end
  return {0, at - now, 1}
end
-- Expired grants (their worker died): their tokens count as used (the
-- `settled` counter written with the rest of the hash, below).
local expired_tokens = 0
local expired = redis.call('ZRANGE', inflight, '+inf', -now, 'BYSCORE', 'REV')
if #expired > 0 then
  for _, id in ipairs(expired) do
    expired_tokens = expired_tokens + (tonumber(string.match(id, ':(%d+)$')) or 0)
  end
  redis.call('ZREMRANGEBYSCORE', inflight, -now, '+inf')
end
local maxc = tonumber(ARGV[5])
local ac = tonumber(s[11])
local learned_conc = false
if ac and (maxc == 0 or math.floor(ac) < maxc) then
  maxc = math.max(1, math.floor(ac))
  learned_conc = true
end
-- Nothing limits the key: a free pass (nothing counted per grant; the
-- expired grants' tokens written back with it).
local pass = tonumber(ARGV[14]) or 0
if pass > 0 and maxc == 0 and limits[1] == 0 and limits[2] == 0 and limits[3] == 0 and limits[4] == 0 then
  local seq = (tonumber(s[15]) or 0) + 1
  local fields = {'at', now, 'seq', string.format('%d', seq)}
  -- The sending rate's window goes on (or starts over after a gap).
  sent(0, fields)
  if expired_tokens > 0 then
    fields[#fields + 1] = 'settled'
    fields[#fields + 1] = string.format('%d', (tonumber(s[17]) or 0) + expired_tokens)
  end
  write(fields)
  return {0, 0, 3, pass, seq}
end
local granted, wait, why = 0, 0, 0
local delays = {}
local in_flight = maxc > 0 and redis.call('ZCARD', inflight) or 0
-- Under a learned concurrency the free passes' calls still out count too
-- (the cut that learned it counted them).
if learned_conc then in_flight = in_flight + free_in_flight(now) end
while granted < want do
  local d = delay_of_next()
  if d > ahead then
    wait, why = come_back(d) - now, 1
    break
  end
  if maxc > 0 and in_flight + granted >= maxc then
    bound[5] = true
    -- A settlement that frees a slot says so (`cw`: someone waits for one),
    -- and the waiting worker is woken then; this is only the longest wait.
    wait, why = 1000, 2
    break
  end
  for k = 1, 4 do
    if limits[k] > 0 then level[k] = level[k] - need[k] end
  end
  granted = granted + 1
  delays[granted] = d
end
-- One sequence step and one ZADD for all of them (the counters written
-- back with the rest of the hash, below).
local ids = {}
local fields = {'at', now}
if granted > 0 then
  local last = (tonumber(s[15]) or 0) + granted
  local members = {}
  for seq = last - granted + 1, last do
    local id = ARGV[12] .. ':' .. string.format('%d', seq) .. ':' .. need[2]
    ids[#ids + 1] = id
    members[#members + 1] = -(now + lease)
    members[#members + 1] = id
  end
  redis.call('ZADD', inflight, unpack(members))
  fields[#fields + 1] = 'seq'
  fields[#fields + 1] = string.format('%d', last)
  fields[#fields + 1] = 'reserved'
  fields[#fields + 1] = string.format('%d', (tonumber(s[16]) or 0) + granted * need[2])
end
if expired_tokens > 0 then
  fields[#fields + 1] = 'settled'
  fields[#fields + 1] = string.format('%d', (tonumber(s[17]) or 0) + expired_tokens)
end
if why == 1 then
  fields[#fields + 1] = 'qt'
  fields[#fields + 1] = now + wait
end
-- A learned limit grows back only while it is what holds the fleet back.
if bound[1] and learned_rate then
  fields[#fields + 1] = 'rb'
  fields[#fields + 1] = now
end
if bound[5] then
  fields[#fields + 1] = 'cw'
  fields[#fields + 1] = now
end
if bound[5] and learned_conc then
  fields[#fields + 1] = 'cb'
  fields[#fields + 1] = now
end
sent(granted, fields)
for k = 1, 4 do
  if limits[k] > 0 then
    fields[#fields + 1] = names[k]
    fields[#fields + 1] = tostring(level[k])
  end
end
write(fields)
local out = {granted, wait, why}
for _, id in ipairs(ids) do out[#out + 1] = id end
for _, d in ipairs(delays) do out[#out + 1] = d end
return out
