-- finish.lua (after counters.lua): settle delivered tasks of one partition and acknowledge them,
-- each atomically (the whole call is one atomic step; a record's outcome is
-- decided exactly as if it were settled alone, in the order given).
--
-- Only for the live delivery: an entry must still be pending for its
-- consumer with its delivery count (the fencing token). A worker whose task
-- was taken over meanwhile (it hung, or was stopped past the visibility
-- timeout) gets -1 for it: nothing changes, and nothing is acknowledged,
-- since the entry now belongs to the worker that took it over.
--
-- A record's state moves only from `queued` or `delayed`; a record already
-- in a terminal state (done, review, dropped, cancelled) is left as it is, so
-- a redelivered or late task never writes a second outcome. Every live entry
-- is acknowledged and deleted from the stream, moved or not.
--
-- KEYS[1]  partition stream        bf:{job:pN}:tasks
-- KEYS[2]  partition state hash    bf:{job:pN}:state
-- KEYS[3]  results hash            bf:{job:pN}:results   (commit)
-- KEYS[4]  delayed sorted set      bf:{job:pN}:delayed   (retry)
-- KEYS[5]  review hash             bf:{job:pN}:review    (review)
-- KEYS[6]  cancelled hash          bf:{job:pN}:cancelled (cancel, for resume)
-- KEYS[7]  partition sink stream   bf:{job:pN}:sink: when it exists (the job
--          has a sink), a record that became done (`k` r) or went to review,
--          was dropped or cancelled (`k` f), and each paid call new to the
--          ledger (`k` l, its key in `c`) are handed to the sink through it
-- KEYS[8]  partition ledger hash    bf:{job:pN}:paid: call key -> the paid call
-- KEYS[9]  partition spend hash     bf:{job:pN}:spend: counters that only grow
-- KEYS[10] partition stats hash     bf:{job:pN}:stats: counters of outcomes
--          (the task's own fields, and per Unix minute of Redis's clock
--          `t<minute>:d` records done, `t<minute>:f` to review or dropped,
--          `t<minute>:c` paid calls, `t<minute>:u` their nano-USD)
-- KEYS[11] partition audit queue   bf:{job:pN}:audit: a commit in mode
--          `commit_audit` (the record is in the spec's spot-check sample)
--          also puts the record there (its result carries its input)
-- KEYS[12] the shard's task hash     bf:{job:pN}:shard:<id> (batch mode): a
--          task with no stream entry id is held by this shard, and its
--          outcome is fenced by the shard still holding it (taken out of
--          the hash by the same step); its record is `batched`, which every
--          move treats as `queued`
-- KEYS[13] partition ledger's calls in the sink  bf:{job:pN}:paid:sunk: with
--          KEYS[8], made to persist again when a call is new to the ledger
--          (a drained fleet left them to expire: see ledger_expire.lua)
-- ARGV[1]  consumer group
-- then 11 per task:
--   stream entry id, record_id,
--   mode: commit | commit_audit | retry | review | drop | cancel | release (back to the
--         stream as a new entry, not called: a halted worker hands its tasks back),
--   value: commit: the encoded result; retry, cancel, release: the encoded
--          task; review: the encoded entry; drop: the reason (passed through unread),
--   retry: due time, Unix ms (0: at once, back on the stream as a new entry
--          without a trip through the delayed set, the caller wakes the
--          fleet unless the provider is taken for down and only a probe
--          takes it; unused otherwise),
--   the consumer the entry was delivered to, its delivery count at that delivery,
--   the paid call it made: its key ('' when none), its encoding, and what it
--   adds to the spend (`bucket prompt cached completion nano-USD estimated`,
--   then for a call not at standard prices its tier and its cost at them
--   in nano-USD: through the Batch API (`batch`, or no name) `batch_calls`,
--   `batch_nusd`, `batch_online_nusd`; another tier (`flex`) `calls@flex`,
--   `nusd@flex`, `std@flex`),
--   the stats fields its outcome adds 1 to when it moves the record
--   (newline-separated; passed through unread).
-- A paid call is recorded whatever happens to the outcome (stale, repeated,
-- already settled: it was paid), and once: only a key new to the ledger
-- counts (a retried store call, or the same call recorded as lost, does not).
-- Returns, per task: 1 when it moved the record, 0 when the record was
-- already settled (acknowledged only), -1 when the delivery is stale (an
-- entry given twice counts as acknowledged by its first: -1 the second time).
local stream, states = KEYS[1], KEYS[2]
local group = ARGV[1]
-- Whether the job has a sink, and the minute's stats fields: looked up
-- once, when a new paid call or a move needs them (a retry needs neither).
local sink_known, sink_exists, minute_fields
local function has_sink()
  if not sink_known then
    sink_known, sink_exists = true, redis.call('EXISTS', KEYS[7]) == 1
  end
  return sink_exists
end
local function per_minute()
  if not minute_fields then
    local minute = 't' .. math.floor(tonumber(redis.call('TIME')[1]) / 60)
    minute_fields = {c = minute .. ':c', u = minute .. ':u', d = minute .. ':d', f = minute .. ':f'}
  end
  return minute_fields
end
local out, acked = {}, {}
local new_calls = false
local spend, stats = {}, {}
local function add(field, n)
  spend[field] = (spend[field] or 0) + n
end
local function count(field, n)
  stats[field] = (stats[field] or 0) + n
end
local function paid(i)
  if ARGV[i + 7] == '' or redis.call('HSETNX', KEYS[8], ARGV[i + 7], ARGV[i + 8]) == 0 then
    return
  end
  new_calls = true
  if has_sink() then
    redis.call('XADD', KEYS[7], '*', 'rid', ARGV[i + 1], 'k', 'l', 'c', ARGV[i + 7])
  end
  local n = add_spend(add, ARGV[i + 9])
  count(per_minute().c, 1)
  count(per_minute().u, n)
end
-- The paid calls first, with their counters: nothing the outcomes do
-- afterwards (an error included) can leave a call recorded but not counted.
for i = 2, #ARGV, 11 do
  paid(i)
end
add_counters(KEYS[9], spend)
-- The fence of every entry of the call at once when there are several, all
-- delivered to one consumer (a worker's own call): one XPENDING of that
-- consumer's entries over their range. An entry it did not return is not
-- that consumer's, unless the reply was cut at its count (the range held
-- many more of the consumer's entries): then it is read alone.
local fence, fenced_all = {}, false
do
  local consumer, lo, hi, n = nil, nil, nil, 0
  local function before(a, b)
    local am, as = string.match(a, '^(%d+)-(%d+)$')
    local bm, bs = string.match(b, '^(%d+)-(%d+)$')
    am, bm = tonumber(am), tonumber(bm)
    return am < bm or (am == bm and tonumber(as) < tonumber(bs))
  end
  for i = 2, #ARGV, 11 do
    local entry = ARGV[i]
    if entry ~= '' then
      if consumer ~= nil and consumer ~= ARGV[i + 5] then
        n = 0
        break
      end
      consumer, n = ARGV[i + 5], n + 1
      if lo == nil or before(entry, lo) then lo = entry end
      if hi == nil or before(hi, entry) then hi = entry end
    end
  end
  if n > 1 then
    local limit = 2 * n + 64
    local got = redis.call('XPENDING', stream, group, lo, hi, limit, consumer)
    for _, e in ipairs(got) do
      fence[e[1]] = e
    end
    fenced_all = #got < limit
  end
end
for i = 2, #ARGV, 11 do
  local entry, rid, mode, value = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local audit = mode == 'commit_audit'
  if audit then
    mode = 'commit'
  end
  local held = entry == ''
  local moved = -1
  local live
  if held then
    live = redis.call('HDEL', KEYS[12], rid) == 1
  else
    local owner = false
    if not acked[entry] then
      owner = fence[entry] or (not fenced_all and redis.call('XPENDING', stream, group, entry, entry, 1)[1])
    end
    live = owner and owner[2] == ARGV[i + 5] and tonumber(owner[4]) == tonumber(ARGV[i + 6])
  end
  if live then
    local state = redis.call('HGET', states, rid)
    local batched = state == 'batched'
    if batched then
      state = 'queued'
    end
    moved = 0
    if mode == 'release' then
      if state == 'queued' then
        redis.call('XADD', stream, '*', 'rid', rid, 'task', value)
        if batched then
          redis.call('HSET', states, rid, 'queued')
        end
        moved = 1
      end
    elseif mode == 'retry' then
      -- Only a record in flight schedules a retry: one already waiting keeps its one.
      if state == 'queued' and ARGV[i + 4] == '0' then
        redis.call('XADD', stream, '*', 'rid', rid, 'task', value)
        if batched then
          redis.call('HSET', states, rid, 'queued')
        end
        moved = 1
      elseif state == 'queued' then
        redis.call('ZADD', KEYS[4], ARGV[i + 4], value)
        redis.call('HSET', states, rid, 'delayed')
        moved = 1
      end
    elseif state == 'queued' or state == 'delayed' then
      if mode == 'commit' then
        if redis.call('HSETNX', KEYS[3], rid, value) == 1 then
          redis.call('HSET', states, rid, 'done')
          moved = 1
          if audit then
            redis.call('HSETNX', KEYS[11], rid, '')
          end
        end
      elseif mode == 'review' then
        redis.call('HSET', KEYS[5], rid, value)
        redis.call('HSET', states, rid, 'review')
        moved = 1
      elseif mode == 'drop' then
        redis.call('HSET', states, rid, 'dropped:' .. value)
        moved = 1
      elseif mode == 'cancel' then
        redis.call('HSET', KEYS[6], rid, value)
        redis.call('HSET', states, rid, 'cancelled')
        moved = 1
      else
        return redis.error_reply('finish.lua: unknown mode ' .. tostring(mode))
      end
    end
    if moved == 1 and mode ~= 'retry' and mode ~= 'release' and has_sink() then
      redis.call('XADD', KEYS[7], '*', 'rid', rid, 'k', mode == 'commit' and 'r' or 'f')
    end
    if moved == 1 then
      for field in string.gmatch(ARGV[i + 10], '[^\n]+') do
        count(field, 1)
      end
      if mode == 'commit' then
        count(per_minute().d, 1)
      elseif mode == 'review' or mode == 'drop' then
        count(per_minute().f, 1)
      end
    end
    if not held then
      acked[#acked + 1] = entry
      acked[entry] = true
    end
  end
  out[#out + 1] = moved
end
if #acked > 0 then
  redis.call('XACK', stream, group, unpack(acked))
  redis.call('XDEL', stream, unpack(acked))
end
add_counters(KEYS[10], stats)
if new_calls then
  redis.call('PERSIST', KEYS[8])
  redis.call('PERSIST', KEYS[13])
end
return out
