-- outage.lua: the job's provider outage, shared by the fleet.
--
-- A transient failure (refused, reset, timeout, 5xx, 429...) is the world's,
-- not the record's, and one worker's view is not enough to call the
-- provider down: every worker adds its failures to one streak here, and any
-- answer (noted by each worker at most once a second, and at once while the
-- provider is down) ends the streak. Once the streak holds `min_fails`
-- failures and no call was answered for `window` ms (a longer window for a
-- streak of 429s only: capacity, not this fleet's pace), the provider is
-- taken for down: workers send nothing but one probe at a time (leased
-- here), each failed probe waiting longer (doubling from 1 s to a cap that
-- grows as the outage lasts: OutageRules::probe_wait), and the first
-- answer ends the outage for everyone. Times are Redis's clock.
--
-- KEYS[1]  the outage hash   bf:{job}:outage
--          ok_ms (last answer noted), since_ms (start of the earliest failed
--          call of the streak), fails, rl_only (1 while every failure of the
--          streak was a 429), down (1 while the provider is taken for down),
--          down_ms, probe_at (when the next probe may start), prober (the
--          worker that holds the probe's lease) and held_ms (when that
--          worker's probe failed: the next probe's lease is its own from
--          probe_at to held_ms, and it sends it without asking),
--          probes (failed probes), cause, message, base_url, worker,
--          last_ms (the last failure), outages (how many so far), up_ms and
--          last_outage_ms (when the last one ended, and how long it lasted)
-- ARGV[1]  fail | ok | probe | unprobe | leave
-- fail:    ARGV[2] how long ago the failed call started, ms
--          ARGV[3] its cause (`connect`, `http_503`, `rate_limited`...)
--          ARGV[4] 1 when it was a 429
--          ARGV[5] the provider's words (scrubbed, bounded)
--          ARGV[6] the base URL (redacted)
--          ARGV[7] the worker
--          ARGV[8] failures in the streak before the provider is down
--          ARGV[9] ms without an answer before it is (ARGV[10]: 429s only)
--          ARGV[11] the longest wait between probes while the outage is
--          young, ms (then a twelfth of its age, at most 6 times this)
--          ARGV[12] 1 when this call was the probe
--          ARGV[13] the probe's lease, ms: the worker whose probe failed
--          while it held the lease holds the next one's from its start on
--          (others are told to wait until that lease ends)
--          Returns {state, since_ms, now, ok_ms, probe_at}: state 0 up,
--          1 down from this failure on, 2 down before it; ok_ms the last
--          answer noted; probe_at, after a failed probe while down of the
--          worker holding the lease, when the next may start (0 otherwise):
--          the prober learns it here and sends the next probe then without
--          asking again. A probe of a worker that no longer held the lease
--          (it ran out) changes nothing of the lease: it is no one's turn.
-- ok:      Returns {1, since_ms, now} when this answer ended an outage,
--          else {0, 0, now}.
-- probe:   ARGV[2] the probe's lease, ms (its call's whole timeout);
--          ARGV[3] the worker asking.
--          Returns {1, 0, now} when the caller may send the probe (or the
--          provider is up), else {0, when to ask again, now}: the next
--          probe's start, or the end of its lease when another worker
--          holds it.
-- unprobe: a probe that found nothing to send gives its lease back (the
--          next may start a second from now, by any worker). Returns {1, 0, now}.
-- leave:   ARGV[2] a stopping worker: the next probe's lease its failed
--          probe left it is given back (the next probe starts when due, by
--          any worker that asks then). Returns {1 when it held it, 0, now}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local h = KEYS[1]
local verb = ARGV[1]

if verb == 'fail' then
  local v = redis.call('HMGET', h, 'ok_ms', 'since_ms', 'fails', 'rl_only', 'down', 'probes', 'down_ms', 'prober')
  local ok = tonumber(v[1]) or 0
  local since = tonumber(v[2])
  local fails = tonumber(v[3]) or 0
  local rl_only = v[4] ~= '0'
  local down = v[5] == '1'
  local started = math.max(now - tonumber(ARGV[2]), ok + 1)
  if down then
    -- The outage keeps the start of its streak.
  elseif since == nil or since <= ok then
    since, fails, rl_only = started, 0, true
  else
    since = math.min(since, started)
  end
  fails = fails + 1
  if ARGV[4] ~= '1' then rl_only = false end
  local fields = {'since_ms', since, 'fails', fails, 'rl_only', rl_only and 1 or 0,
    'cause', ARGV[3], 'message', ARGV[5], 'base_url', ARGV[6], 'worker', ARGV[7], 'last_ms', now}
  local probe_at = 0
  if down and ARGV[12] == '1' and v[8] == ARGV[7] then
    local probes = (tonumber(v[6]) or 0) + 1
    local max = tonumber(ARGV[11])
    local age = now - (tonumber(v[7]) or now)
    local cap = math.min(math.max(math.floor(age / 12), max), 6 * max)
    probe_at = now + math.floor(math.min(1000 * math.pow(2, math.min(probes, 20)), cap))
    for _, f in ipairs({'probes', probes, 'probe_at', probe_at, 'held_ms', probe_at + tonumber(ARGV[13]), 'prober', ARGV[7]}) do
      table.insert(fields, f)
    end
  end
  redis.call('HSET', h, unpack(fields))
  if down then
    return {2, since, now, ok, probe_at}
  end
  local window = tonumber(ARGV[9])
  if rl_only then window = tonumber(ARGV[10]) end
  if fails >= tonumber(ARGV[8]) and now - since >= window then
    redis.call('HSET', h, 'down', 1, 'down_ms', now, 'probes', 0, 'probe_at', now + 1000, 'held_ms', 0, 'prober', '')
    redis.call('HINCRBY', h, 'outages', 1)
    return {1, since, now, ok, 0}
  end
  return {0, since, now, ok, 0}
end

if verb == 'ok' then
  local v = redis.call('HMGET', h, 'down', 'since_ms')
  if v[1] == '1' then
    local since = tonumber(v[2]) or now
    redis.call('HDEL', h, 'down', 'probe_at', 'probes', 'held_ms', 'prober')
    redis.call('HSET', h, 'ok_ms', now, 'up_ms', now, 'last_outage_ms', now - since)
    return {1, since, now}
  end
  redis.call('HSET', h, 'ok_ms', now)
  return {0, 0, now}
end

if verb == 'probe' then
  local v = redis.call('HMGET', h, 'down', 'probe_at', 'held_ms', 'prober')
  if v[1] ~= '1' then return {1, 0, now} end
  local at = tonumber(v[2]) or 0
  if now < at then return {0, at, now} end
  local held = tonumber(v[3]) or 0
  if now < held and v[4] ~= ARGV[3] then return {0, held, now} end
  redis.call('HSET', h, 'probe_at', now + tonumber(ARGV[2]), 'held_ms', 0, 'prober', ARGV[3])
  return {1, 0, now}
end

if verb == 'unprobe' then
  if redis.call('HGET', h, 'down') == '1' then
    redis.call('HSET', h, 'probe_at', now + 1000, 'held_ms', 0, 'prober', '')
  end
  return {1, 0, now}
end

if verb == 'leave' then
  local v = redis.call('HMGET', h, 'prober', 'held_ms')
  if v[1] == ARGV[2] and (tonumber(v[2]) or 0) > now then
    redis.call('HSET', h, 'held_ms', 0, 'prober', '')
    return {1, 0, now}
  end
  return {0, 0, now}
end

return redis.error_reply('outage.lua: unknown verb ' .. tostring(verb))
