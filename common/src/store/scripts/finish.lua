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
-- A hash's fields read, and written, in one command a thousand rather than
-- one a field: a command run from Lua costs far more than the little each
-- of these does. The call is one atomic step, so what they read and leave
-- is what the commands a field would have (the writes are kept in order in
-- `writes`, and what the call itself wrote is what it reads afterwards).
local function read_fields(key, fields)
  local got = {}
  for a = 1, #fields, 1000 do
    local part = redis.call('HMGET', key, unpack(fields, a, math.min(a + 999, #fields)))
    for j = 1, #part do
      got[fields[a + j - 1]] = part[j]
    end
  end
  return got
end
local function write_fields(key, writes)
  local flat = {}
  for _, field in ipairs(writes) do
    flat[#flat + 1] = field
    flat[#flat + 1] = writes[field]
  end
  for a = 1, #flat, 1000 do
    redis.call('HSET', key, unpack(flat, a, math.min(a + 999, #flat)))
  end
end
local function set_field(writes, field, value)
  if writes[field] == nil then
    writes[#writes + 1] = field
  end
  writes[field] = value
end
for i = 2, #ARGV, 11 do
  local mode = ARGV[i + 2]
  if mode ~= 'commit' and mode ~= 'commit_audit' and mode ~= 'retry' and mode ~= 'review' and mode ~= 'drop'
      and mode ~= 'cancel' and mode ~= 'release' then
    return redis.error_reply('finish.lua: unknown mode ' .. tostring(mode))
  end
end
-- The paid calls first, with their counters: nothing the outcomes do
-- afterwards can leave a call recorded but not counted. A key already in
-- the ledger, or met earlier in this call, is not new.
do
  local keys = {}
  for i = 2, #ARGV, 11 do
    if ARGV[i + 7] ~= '' then
      keys[#keys + 1] = ARGV[i + 7]
    end
  end
  local ledger, writes, lines, new = read_fields(KEYS[8], keys), {}, {}, {}
  for i = 2, #ARGV, 11 do
    local key = ARGV[i + 7]
    if key ~= '' and not ledger[key] then
      ledger[key] = true
      set_field(writes, key, ARGV[i + 8])
      new[#new + 1] = i
      -- Calls of the same spend line are counted together.
      set_field(lines, ARGV[i + 9], (lines[ARGV[i + 9]] or 0) + 1)
    end
  end
  -- Counted before anything is written: a spend line that cannot be read
  -- fails the call with nothing recorded.
  for _, line in ipairs(lines) do
    local times = lines[line]
    local n = add_spend(add, line, times)
    count(per_minute().c, times)
    count(per_minute().u, n * times)
  end
  write_fields(KEYS[8], writes)
  new_calls = #new > 0
  if new_calls and has_sink() then
    for _, i in ipairs(new) do
      redis.call('XADD', KEYS[7], '*', 'rid', ARGV[i + 1], 'k', 'l', 'c', ARGV[i + 7])
    end
  end
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
  local lo_ms, lo_seq, hi_ms, hi_seq
  for i = 2, #ARGV, 11 do
    local entry = ARGV[i]
    if entry ~= '' then
      if consumer ~= nil and consumer ~= ARGV[i + 5] then
        n = 0
        break
      end
      consumer, n = ARGV[i + 5], n + 1
      local ms, seq = string.match(entry, '^(%d+)-(%d+)$')
      ms, seq = tonumber(ms), tonumber(seq)
      if lo == nil or ms < lo_ms or (ms == lo_ms and seq < lo_seq) then
        lo, lo_ms, lo_seq = entry, ms, seq
      end
      if hi == nil or ms > hi_ms or (ms == hi_ms and seq > hi_seq) then
        hi, hi_ms, hi_seq = entry, ms, seq
      end
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
-- Which deliveries are live, in order (an entry given twice is live the
-- first time only), then the states of their records and, for a commit,
-- whether the record has a result, each in one read.
local live, rids, committed = {}, {}, {}
for i = 2, #ARGV, 11 do
  local entry, rid = ARGV[i], ARGV[i + 1]
  if entry == '' then
    live[i] = redis.call('HDEL', KEYS[12], rid) == 1
  elseif not acked[entry] then
    local owner = fence[entry] or (not fenced_all and redis.call('XPENDING', stream, group, entry, entry, 1)[1])
    live[i] = owner and owner[2] == ARGV[i + 5] and tonumber(owner[4]) == tonumber(ARGV[i + 6]) or false
    if live[i] then
      acked[#acked + 1] = entry
      acked[entry] = true
    end
  end
  if live[i] then
    rids[#rids + 1] = rid
    if string.sub(ARGV[i + 2], 1, 6) == 'commit' then
      committed[#committed + 1] = rid
    end
  end
end
local state_of, result_of = read_fields(states, rids), read_fields(KEYS[3], committed)
local state_writes, result_writes, stat_lines = {}, {}, {}
local function set_state(rid, state)
  state_of[rid] = state
  set_field(state_writes, rid, state)
end
for i = 2, #ARGV, 11 do
  local rid, mode, value = ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local audit = mode == 'commit_audit'
  if audit then
    mode = 'commit'
  end
  local moved = -1
  if live[i] then
    local state = state_of[rid]
    local batched = state == 'batched'
    if batched then
      state = 'queued'
    end
    moved = 0
    if mode == 'release' then
      if state == 'queued' then
        redis.call('XADD', stream, '*', 'rid', rid, 'task', value)
        if batched then
          set_state(rid, 'queued')
        end
        moved = 1
      end
    elseif mode == 'retry' then
      -- Only a record in flight schedules a retry: one already waiting keeps its one.
      if state == 'queued' and ARGV[i + 4] == '0' then
        redis.call('XADD', stream, '*', 'rid', rid, 'task', value)
        if batched then
          set_state(rid, 'queued')
        end
        moved = 1
      elseif state == 'queued' then
        redis.call('ZADD', KEYS[4], ARGV[i + 4], value)
        set_state(rid, 'delayed')
        moved = 1
      end
    elseif state == 'queued' or state == 'delayed' then
      if mode == 'commit' then
        if not result_of[rid] then
          result_of[rid] = true
          set_field(result_writes, rid, value)
          set_state(rid, 'done')
          moved = 1
          if audit then
            redis.call('HSETNX', KEYS[11], rid, '')
          end
        end
      elseif mode == 'review' then
        redis.call('HSET', KEYS[5], rid, value)
        set_state(rid, 'review')
        moved = 1
      elseif mode == 'drop' then
        set_state(rid, 'dropped:' .. value)
        moved = 1
      else
        redis.call('HSET', KEYS[6], rid, value)
        set_state(rid, 'cancelled')
        moved = 1
      end
    end
    if moved == 1 and mode ~= 'retry' and mode ~= 'release' and has_sink() then
      redis.call('XADD', KEYS[7], '*', 'rid', rid, 'k', mode == 'commit' and 'r' or 'f')
    end
    if moved == 1 then
      set_field(stat_lines, ARGV[i + 10], (stat_lines[ARGV[i + 10]] or 0) + 1)
      if mode == 'commit' then
        count(per_minute().d, 1)
      elseif mode == 'review' or mode == 'drop' then
        count(per_minute().f, 1)
      end
    end
  end
  out[#out + 1] = moved
end
write_fields(KEYS[3], result_writes)
write_fields(states, state_writes)
if #acked > 0 then
  redis.call('XACK', stream, group, unpack(acked))
  redis.call('XDEL', stream, unpack(acked))
end
-- The stats fields of the outcomes that moved, each set of them once.
for _, line in ipairs(stat_lines) do
  for field in string.gmatch(line, '[^\n]+') do
    count(field, stat_lines[line])
  end
end
add_counters(KEYS[10], stats)
if new_calls then
  redis.call('PERSIST', KEYS[8])
  redis.call('PERSIST', KEYS[13])
end
return out
