-- One page of the record ids a hash holds (its fields), without the values:
-- reconciliation reads every id of a job, and the values (results, review
-- entries) are most of the bytes, so they stay in Redis. (A stream's ids are
-- read with XRANGE by the client: turning each entry into a Lua table cost
-- Redis five times the XRANGE itself.)
--
-- KEYS[1]  the hash
-- ARGV[1]  the HSCAN cursor (`0` for the first page)
-- ARGV[2]  page size
-- Returns {next, rid, rid, ...}: the next cursor (`0` at the end).
local page = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', tonumber(ARGV[2]))
local out = {page[1]}
local items = page[2]
for j = 1, #items, 2 do
  out[#out + 1] = items[j]
end
return out
