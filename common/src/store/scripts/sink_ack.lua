-- Acknowledges a batch of a partition's sink stream once the sink holds it
-- durably, and takes the results it wrote out of Redis, with their records'
-- idempotency keys (the state entry, which lives as long as the job, keeps
-- a re-enqueue from adding them again) and origins entries: what stays is
-- the record's state entry, `d@<origin>`, and the partition's `sunk`
-- counters keep the figures of what left (each result counted once: only
-- when it is removed). Paid calls the sink holds leave the ledger hash
-- after `hold_ms` (until then the same call stored again is still known,
-- and counted once); every call trims those whose time has come.
--
-- KEYS[1]  partition sink stream   bf:{job:pN}:sink
-- KEYS[2]  partition results hash  bf:{job:pN}:results
-- KEYS[3]  partition sunk counters bf:{job:pN}:sunk
-- KEYS[4]  partition state hash    bf:{job:pN}:state
-- KEYS[5]  partition origins hash  bf:{job:pN}:origin
-- KEYS[6]  partition ledger hash   bf:{job:pN}:paid
-- KEYS[7]  its calls in the sink   bf:{job:pN}:paid:sunk (sorted set, by when they may leave)
-- KEYS[7+i] the idempotency key of the i-th result below  bf:{job:pN}:idem:<record_id>
-- ARGV[1]  consumer group
-- ARGV[2]  rows that were new in the sink
-- ARGV[3]  hold_ms: how long a paid call the sink holds stays in the ledger hash
-- ARGV[4]  n, the number of stream entry ids that follow
-- ARGV[5]  m, the number of paid call keys the sink holds that follow them
-- ARGV[6 .. 5+n]  the entry ids
-- ARGV[6+n .. 5+n+m]  the paid call keys
-- then, per result the sink holds: record_id, attempts, prompt, completion, cached tokens
-- Returns {results removed, paid calls that left the ledger hash} (at most
-- 1,000 leave per call: a caller that trimmed that many calls again).
local call = redis.call
-- `cmd key args...` in chunks (Lua's unpack takes at most a few thousand values).
local function chunked(cmd, key, args, from, to, step)
  for a = from, to, step do
    if key then
      call(cmd, key, unpack(args, a, math.min(a + step - 1, to)))
    else
      call(cmd, unpack(args, a, math.min(a + step - 1, to)))
    end
  end
end
local stream, results, sunk, states, origins = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local ledger, ledger_sunk = KEYS[6], KEYS[7]
local n, m = tonumber(ARGV[4]), tonumber(ARGV[5])
local t = call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Paid calls that may leave now, then those the sink holds from now on.
local due = call('ZRANGEBYSCORE', ledger_sunk, '-inf', now, 'LIMIT', 0, 1000)
if #due > 0 then
  chunked('HDEL', ledger, due, 1, #due, 1000)
  chunked('ZREM', ledger_sunk, due, 1, #due, 1000)
end
local leave = now + tonumber(ARGV[3])
for i = 6 + n, 5 + n + m do
  if call('HGET', ledger, ARGV[i]) then
    call('ZADD', ledger_sunk, 'NX', leave, ARGV[i])
  end
end
if n > 0 then
  local ids = {}
  for i = 6, 5 + n do
    ids[#ids + 1] = ARGV[i]
  end
  for a = 1, #ids, 1000 do
    call('XACK', stream, ARGV[1], unpack(ids, a, math.min(a + 999, #ids)))
  end
  chunked('XDEL', stream, ids, 1, #ids, 1000)
end
local written = tonumber(ARGV[2])
if written > 0 then
  call('HINCRBY', sunk, 'written', written)
end
-- The results the sink holds, in one read each of their states and origins.
local rids, nums = {}, {}
for i = 6 + n + m, #ARGV, 5 do
  rids[#rids + 1] = ARGV[i]
  nums[#nums + 1] = i
end
if #rids == 0 then
  return {0, #due}
end
chunked('DEL', nil, KEYS, 8, 7 + #rids, 1000)
local st, og = {}, {}
for a = 1, #rids, 1000 do
  local part = {unpack(rids, a, math.min(a + 999, #rids))}
  local s, o = call('HMGET', states, unpack(part)), call('HMGET', origins, unpack(part))
  for j = 1, #part do
    st[a + j - 1], og[a + j - 1] = s[j], o[j]
  end
end
local marked, gone = {}, {}
local removed, prompt, completion, cached, by_attempts = 0, 0, 0, 0, {}
for j, rid in ipairs(rids) do
  if st[j] == 'done' and og[j] then
    marked[#marked + 1] = rid
    marked[#marked + 1] = 'd@' .. og[j]
    gone[#gone + 1] = rid
  end
  if call('HDEL', results, rid) == 1 then
    local i = nums[j]
    removed = removed + 1
    by_attempts[ARGV[i + 1]] = (by_attempts[ARGV[i + 1]] or 0) + 1
    prompt = prompt + tonumber(ARGV[i + 2])
    completion = completion + tonumber(ARGV[i + 3])
    cached = cached + tonumber(ARGV[i + 4])
  end
end
if #marked > 0 then
  chunked('HSET', states, marked, 1, #marked, 1000)
  chunked('HDEL', origins, gone, 1, #gone, 1000)
end
if removed > 0 then
  call('HINCRBY', sunk, 'done', removed)
  call('HINCRBY', sunk, 'prompt', prompt)
  call('HINCRBY', sunk, 'completion', completion)
  call('HINCRBY', sunk, 'cached', cached)
  for attempts, count in pairs(by_attempts) do
    call('HINCRBY', sunk, 'a' .. attempts, count)
  end
end
return {removed, #due}
