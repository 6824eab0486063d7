-- counters.lua: the prelude of the scripts that count paid calls (finish.lua,
-- ledger.lua); it is put before each of them as it is loaded.
--
-- add_spend(add, spend, times): what `times` paid calls (one when not given)
-- with the same spend line add to the spend counters, from
-- its spend line (`bucket prompt cached completion nano-USD estimated`, then
-- for a call not at standard prices its tier and its cost at them in nano-USD:
-- through the Batch API (`batch`, or no name) `batch_calls`, `batch_nusd`,
-- `batch_online_nusd`; another tier (`flex`) `calls@flex`, `nusd@flex`,
-- `std@flex`), each through `add(field, n)`. Returns one call's nano-USD.
--
-- add_counters(key, adds): adds each `adds[field]` to that counter of hash
-- `key`, in two commands for the lot (one HMGET, one HSET) rather than one
-- HINCRBY a field (a lone field: its HINCRBY). The script is one atomic
-- step, so the sums are those the HINCRBYs would leave. A counter of 16
-- digits or more (past what Lua's numbers, doubles, hold exactly once added
-- to), or one that is not a whole number, is left to HINCRBY (which
-- refuses the latter, as it always did).
local function add_spend(add_one, spend, times)
  times = times or 1
  local function add(field, n)
    add_one(field, n * times)
  end
  local bucket, p, k, c, n, e, rest = string.match(spend, '^(%S+) (%d+) (%d+) (%d+) (%d+) (%d)(.*)$')
  -- A route's name and the call's cost at standard prices; a bare number: the Batch API's.
  local tier, o = string.match(rest, '^ (%a[%w_-]*) (%d+)$')
  if not tier then
    tier, o = '', string.match(rest, '^ ?(%d*)$') or ''
  end
  add('calls', 1)
  add('prompt', tonumber(p))
  add('cached', tonumber(k))
  add('completion', tonumber(c))
  add('nusd', tonumber(n))
  add('calls:' .. bucket, 1)
  add('nusd:' .. bucket, tonumber(n))
  if e == '1' then
    add('est_calls', 1)
    add('est_nusd', tonumber(n))
    add('est_tokens', tonumber(p) + tonumber(c))
  end
  if o ~= '' and (tier == '' or tier == 'batch') then
    add('batch_calls', 1)
    add('batch_nusd', tonumber(n))
    add('batch_online_nusd', tonumber(o))
  elseif o ~= '' then
    add('calls@' .. tier, 1)
    add('nusd@' .. tier, tonumber(n))
    add('std@' .. tier, tonumber(o))
  end
  return tonumber(n)
end

local function add_counters(key, adds)
  local fields = {}
  for field in pairs(adds) do
    fields[#fields + 1] = field
  end
  if #fields < 2 then
    for _, field in ipairs(fields) do
      redis.call('HINCRBY', key, field, adds[field])
    end
    return
  end
  local now = redis.call('HMGET', key, unpack(fields))
  local set = {}
  for i, field in ipairs(fields) do
    local was, n = now[i], adds[field]
    local sum = was == false and 0 or (#was <= 15 and string.match(was, '^-?%d+$') and tonumber(was))
    if sum and n < 1e15 then
      set[#set + 1] = field
      set[#set + 1] = string.format('%.0f', sum + n)
    else
      redis.call('HINCRBY', key, field, n)
    end
  end
  if #set > 0 then
    redis.call('HSET', key, unpack(set))
  end
end
