-- limit_settle.lua: settle grants with what really happened, atomically: each
-- exactly as if it were settled alone, in the order given (one call settles
-- the grants of many calls; the hash is read once and written once).
--
-- Frees the grant's concurrency slot; returns to the token buckets what was
-- reserved but not used (or takes more, when the estimate was low); learns
-- the provider's limits and remaining budget from its headers (only ever
-- tightening: `remaining` below our level lowers it); and on a 429 pauses the
-- whole fleet until the provider's retry hint.
--
-- A 429 with a retry hint, when the fleet paces itself under a limit it
-- knows (the spec's ceiling, the provider's header limit while fresh, or
-- one learned), is taken as about that request, which waits the hint by
-- itself (the record's own retry): the fleet goes on at 0.95 of the limit
-- it paced at (learned `ar`, once per congestion event), not paused. A
-- proxy such as LiteLLM says "retry after 60" whatever its window's real
-- reset, so pausing the fleet on each would stop it for a minute. A storm
-- (the third fresh hinted 429 within 10 s: `qn` since `qt`) pauses the
-- fleet as long as the hint says, at most until the next whole minute of
-- the server's clock and a second (when a calendar minute's window is new);
-- a hint with no known limit pauses it as long as it says.
--
-- The adaptive controller (AIMD, shared by the fleet): a bare 429 (no retry
-- hint: a hinted one is handled as above) cuts the
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
-- KEYS[2]  in-flight zset    bf:{rl:ID}:slots (scored by minus the expiry)
-- KEYS[3]  free grants in flight (see limit_free.lua, the prelude): a cut
--          counts them with the slots
-- ARGV[1..3]  the settling limiter's word on its free passes (see
--          limit_free.lua): its grant id prefix, the grants it took since
--          it last said (0), those in flight now (-1: nothing to say)
-- ARGV[4]  the slot lease, ms (how long that word holds)
-- then, 15 per grant:
--   grant id (prefix:seq:reserved_tokens; the reserved tokens are added to
--     the `settled` counter),
--   reserved minus used: total, input, output tokens (may be negative),
--   header limit of requests/min, of tokens/min (-1 = unknown),
--   header remaining requests, remaining tokens (-1 = unknown),
--   pause the fleet for this many ms (0 = no pause),
--   what the call did: `ok` (answered), `limited` (bare 429), `hinted` (429
--     with a retry hint), `timeout` (no answer in time; the server may still
--     be working on it), or `other`,
--   after a timeout, keep the concurrency slot this many ms more,
--   the spec's requests/min ceiling, its concurrency ceiling (0 = none),
--   how old the header figures are, ms (the settlement may have waited for
--   others: a `remaining` figure is taken as of when the headers came, and
--   set in the levels' frame, the buckets' last refill `at`, at the rate
--   the acquire applies: a figure settled late is not taken for fresher,
--   nor a fresh one for older; grants given between its reading and its
--   settlement, which it does not count, leave it that much looser),
--   the spec's tokens/min ceiling (0 = none)
-- Returns, per grant: 1 if it was still held, 0 if it had expired or was
-- settled already; then 1 if a worker waited for a concurrency slot and one
-- came free (the caller wakes the fleet: `bf:wake` is in another slot), else 0.
local b, inflight = KEYS[1], KEYS[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local names = {'t', 'i', 'o', 'r', 'hr', 'ht', 'hat', 'pause', 'ar', 'rb', 'ac', 'cb', 'dseq', 'wn', 'ws', 'pr', 'seq', 'bn', 'bt', 'cw', 'sw', 'qn', 'qt', 'settled', 'at'}
local got = redis.call('HMGET', b, unpack(names))
-- The hash as it is now, changed here and written back once at the end
-- (numbers turn back into text once, there).
local h, dirty = {}, {}
for k, name in ipairs(names) do h[name] = got[k] end
local function set(field, v)
  h[field] = v
  dirty[field] = true
end
local function add(field, delta)
  local v = tonumber(h[field])
  if v ~= nil and delta ~= 0 then set(field, v + delta) end
end
local settled, out = 0, {}
-- One more 429 in the streak counted in fields `n` (since `t`, ms), which
-- starts over after 10 s; returns the streak's length.
local function streak(n, t)
  local count, since = (tonumber(h[n]) or 0) + 1, tonumber(h[t]) or now
  if now - since > 10000 then count, since = 1, now end
  set(n, count)
  set(t, since)
  return count
end
-- A provider's remaining budget `left`, seen at `seen`, lowers a level
-- that says more, taken in the levels' frame: the acquire refills them
-- from the buckets' last refill `at` at the limit it applies (`rate`), so
-- what that rate adds between `at` and `seen` is taken off (a figure seen
-- after `at`) or added (seen before). With no limit known the level is
-- not used (the acquire gives grants without it): the figure as it is.
local at = tonumber(h['at'])
local function tighten(field, left, rate, seen)
  local v = tonumber(h[field])
  if left < 0 or v == nil then return end
  if at and rate > 0 then left = left - (seen - at) * rate / 60000 end
  if left < v then set(field, left) end
end
-- The rate the acquire applies: the tightest of the spec's (`spec`, 0 =
-- none), the provider's header limit seen in the last minute (`hr`, `ht`;
-- this answer's included) and, for requests, the one learned from 429s.
local function lower(r, l)
  if l and l > 0 and (r == 0 or l < r) then return l end
  return r
end
local function rate_of(spec, field)
  local r = spec
  if (tonumber(h['hat']) or 0) > now - 60000 then r = lower(r, tonumber(h[field])) end
  if field == 'hr' then r = lower(r, tonumber(h['ar'])) end
  return r
end
-- The settling limiter's word on its free passes, before the grants: a
-- 429 on a free grant may cut at once, from what they sent and hold.
free_told(ARGV[1], tonumber(ARGV[2]) or 0, tonumber(ARGV[3]) or -1, now, tonumber(ARGV[4]) or 0, function(n)
  if h['ws'] == nil then set('ws', now) end
  set('wn', (tonumber(h['wn']) or 0) + n)
end)
-- Grants start after the word.
local G = 5
-- Which grants are still held is read for all of them at once (ZMSCORE),
-- and they are freed in one ZREM, as the ZREMs one by one would leave the
-- set: a grant given twice in the call is held only its first time. `left`
-- counts the held grants the loop has not passed yet, which one by one
-- would still be in the set (the concurrency a bare 429 cuts from, below).
local held_of, left = {}, 0
do
  local ids, taking, once = {}, {}, {}
  for g = G, #ARGV, 15 do
    ids[#ids + 1] = ARGV[g]
  end
  local scores = redis.call('ZMSCORE', inflight, unpack(ids))
  for k, id in ipairs(ids) do
    held_of[k] = 0
    if scores[k] and not once[id] then
      once[id] = true
      held_of[k] = 1
      taking[#taking + 1] = id
    end
  end
  left = #taking
  if left > 0 then redis.call('ZREM', inflight, unpack(taking)) end
end
for g = G, #ARGV, 15 do
  local id = ARGV[g]
  local held = held_of[(g - G) / 15 + 1]
  if held == 1 then
    settled = settled + (tonumber(string.match(id, ':(%d+)$')) or 0)
    add('t', tonumber(ARGV[g + 1]))
    add('i', tonumber(ARGV[g + 2]))
    add('o', tonumber(ARGV[g + 3]))
  end
  local hr, ht = tonumber(ARGV[g + 4]), tonumber(ARGV[g + 5])
  if hr > 0 or ht > 0 then
    if hr > 0 then set('hr', hr) end
    if ht > 0 then set('ht', ht) end
    set('hat', now)
  end
  local seen = now - tonumber(ARGV[g + 13])
  tighten('r', tonumber(ARGV[g + 6]), rate_of(tonumber(ARGV[g + 11]), 'hr'), seen)
  tighten('t', tonumber(ARGV[g + 7]), rate_of(tonumber(ARGV[g + 14]), 'ht'), seen)
  local kind = ARGV[g + 9]
  -- Whether this grant's pause applies, and until when at the latest (see
  -- the hinted 429 above).
  local hint_pause, hint_until = true, nil
  if held == 1 and kind == 'timeout' and tonumber(ARGV[g + 10]) > 0 then
    -- Its tokens are settled above; the slot stays taken (0 tokens at expiry).
    redis.call('ZADD', inflight, -(now + tonumber(ARGV[g + 10])), id .. ':grace:0')
  end
  if kind == 'limited' then
    local seq = tonumber(string.match(id, ':(%d+):%d+$')) or 0
    local fresh = seq > (tonumber(h['dseq']) or 0)
    -- Only 429s on grants taken after the last cut count towards the next one.
    if fresh and streak('bn', 'bt') >= 2 then
      local ws = tonumber(h['ws']) or now
      local sending = math.max(tonumber(h['pr']) or 0, (tonumber(h['wn']) or 0) * 60000 / math.max(now - ws, 1000))
      local ar = tonumber(h['ar'])
      -- The cut is from what the fleet was sending, never below half the
      -- learned rate at once (a window that included a pause reads low).
      if ar == nil then ar = sending elseif sending < ar then ar = math.max(sending, ar * 0.5 / 0.7) end
      local n = redis.call('ZCARD', inflight) + left + free_in_flight(now)
      local ac = tonumber(h['ac'])
      if ac == nil or n < ac then ac = n end
      -- The request bucket restarts empty: no burst into a provider just refused.
      set('dseq', h['seq'] or 0)
      set('ar', tostring(math.max(1, ar * 0.7)))
      set('ac', tostring(math.max(1, ac * 0.7)))
      set('r', 0)
      set('bn', 0)
    end
  elseif kind == 'hinted' then
    local seq = tonumber(string.match(id, ':(%d+):%d+$')) or 0
    local fresh = seq > (tonumber(h['dseq']) or 0)
    local pace = tonumber(h['ar'])
    local function tighter(l)
      if l and l > 0 and (pace == nil or l < pace) then pace = l end
    end
    tighter(tonumber(ARGV[g + 11]))
    if (tonumber(h['hat']) or 0) > now - 60000 then tighter(tonumber(h['hr'])) end
    if pace ~= nil then
      local storm = fresh and streak('qn', 'qt') >= 3
      if fresh then
        set('dseq', h['seq'] or 0)
        set('ar', tostring(math.max(1, pace * 0.95)))
      end
      if storm then
        set('qn', 0)
        -- A per-minute window counted per calendar minute (LiteLLM, most
        -- proxies) is new at the next whole minute, whatever the hint says.
        hint_until = (math.floor(now / 60000) + 1) * 60000 + 1000
      else
        hint_pause = false
      end
    end
  elseif kind == 'ok' then
    local ar, ac = tonumber(h['ar']), tonumber(h['ac'])
    local ceil_r, ceil_c = tonumber(ARGV[g + 11]), tonumber(ARGV[g + 12])
    if ar and now - (tonumber(h['rb']) or 0) < 5000 then
      ar = ar + 0.5
      if ceil_r > 0 and ar >= ceil_r then set('ar', false) else set('ar', tostring(ar)) end
    end
    if ac and now - (tonumber(h['cb']) or 0) < 5000 then
      ac = ac + 1 / ac
      if ceil_c > 0 and ac >= ceil_c then set('ac', false) else set('ac', tostring(ac)) end
    end
  end
  local pause = tonumber(ARGV[g + 8])
  if pause > 0 and hint_pause then
    local until_ms = math.min(now + pause, hint_until or (now + pause))
    local cur = tonumber(h['pause']) or 0
    if until_ms > cur then set('pause', until_ms) end
  end
  out[#out + 1] = held
  left = left - held
  -- A slot came free while a worker waited for one: the waiting workers
  -- are woken, at most every 100 ms (each wake-up wakes them all; a busy
  -- fleet of many workers would otherwise ask for the slot many times over;
  -- those not woken ask again after the wait acquire named, at most 1 s).
  if held == 1 and h['cw'] and now - (tonumber(h['sw']) or 0) >= 100 then
    set('cw', false)
    set('sw', now)
  end
end
local waiting = 0
if dirty['cw'] and h['cw'] == false then waiting = 1 end
if settled > 0 then
  set('settled', string.format('%d', (tonumber(h['settled']) or 0) + settled))
end
-- Written back: changed fields set, dropped ones (a learned limit that
-- reached the spec's ceiling) deleted.
local fields, gone = {}, {}
for _, name in ipairs(names) do
  if dirty[name] then
    if h[name] == false then
      gone[#gone + 1] = name
    else
      fields[#fields + 1] = name
      fields[#fields + 1] = tostring(h[name])
    end
  end
end
if #fields > 0 then redis.call('HSET', b, unpack(fields)) end
if #gone > 0 then redis.call('HDEL', b, unpack(gone)) end
out[#out + 1] = waiting
return out
