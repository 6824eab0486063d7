-- ledger.lua (after counters.lua): record paid calls that left no outcome
-- (cut off at a worker's drain timeout; answered, but the outcome could not
-- be stored in time) in one partition's ledger, with the spend counters,
-- atomically.
--
-- KEYS[1]  partition ledger hash    bf:{job:pN}:paid
-- KEYS[2]  partition spend hash     bf:{job:pN}:spend
-- KEYS[3]  partition sink stream    bf:{job:pN}:sink: when it exists (the job
--          has a sink), each call new to the ledger is handed to the sink
--          (`rid`, `k` l, `c` its key), as in finish.lua
-- KEYS[4]  partition stats hash     bf:{job:pN}:stats: paid calls and their
--          nano-USD per Unix minute (`t<minute>:c`, `t<minute>:u`), as in finish.lua
-- KEYS[5]  partition ledger's calls in the sink  bf:{job:pN}:paid:sunk: with
--          KEYS[1], made to persist again when a call is new to the ledger
--          (a drained fleet left them to expire: see ledger_expire.lua)
-- then 3 per call: its key (`<record id>:<call>:<nonce>`), its encoding, and
-- what it adds to the spend (`bucket prompt cached completion nano-USD
-- estimated`, and the online cost of a call through the Batch API, as in
-- finish.lua).
-- A key already in the ledger is not counted again.
-- Returns the number of calls recorded.
local has_sink = redis.call('EXISTS', KEYS[3]) == 1
local minute = 't' .. math.floor(tonumber(redis.call('TIME')[1]) / 60)
local spend = {}
local function add(field, n)
  spend[field] = (spend[field] or 0) + n
end
local n = 0
for i = 1, #ARGV, 3 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 then
    if has_sink then
      redis.call('XADD', KEYS[3], '*', 'rid', string.match(ARGV[i], '^(.*):[^:]*:[^:]*$') or '', 'k', 'l', 'c', ARGV[i])
    end
    add_spend(add, ARGV[i + 2])
    n = n + 1
  end
end
add_counters(KEYS[2], spend)
if n > 0 then
  redis.call('PERSIST', KEYS[1])
  redis.call('PERSIST', KEYS[5])
  add_counters(KEYS[4], {[minute .. ':c'] = n, [minute .. ':u'] = spend['nusd'] or 0})
end
return n
