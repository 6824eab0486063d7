-- One page of the record ids a stream or a hash holds, without the values:
-- reconciliation reads every id of a job, and the values (tasks, results,
-- review entries) are most of the bytes, so they stay in Redis.
--
-- KEYS[1]  the stream or the hash
-- ARGV[1]  `stream` or `hash`
-- ARGV[2]  stream: the entry id to read after (`-` for the first page);
--          hash: the HSCAN cursor (`0` for the first page)
-- ARGV[3]  page size
-- Returns {next, rid, rid, ...}: for a stream the last entry id read (``
-- when the stream is read to its end), for a hash the next cursor (`0` at
-- the end). A stream entry without a `rid` field gives ``.
local key, kind, from, count = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
local out = {''}
if kind == 'stream' then
  local start = from
  if from ~= '-' then
    start = '(' .. from
  end
  local entries = redis.call('XRANGE', key, start, '+', 'COUNT', count)
  for i, e in ipairs(entries) do
    local fields, rid = e[2], ''
    for j = 1, #fields, 2 do
      if fields[j] == 'rid' then
        rid = fields[j + 1]
        break
      end
    end
    out[i + 1] = rid
  end
  if #entries == count then
    out[1] = entries[#entries][1]
  end
else
  local page = redis.call('HSCAN', key, from, 'COUNT', count)
  out[1] = page[1]
  local items = page[2]
  for j = 1, #items, 2 do
    out[#out + 1] = items[j]
  end
end
return out
