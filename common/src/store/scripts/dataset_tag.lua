-- The job's short tag of a dataset (1, 2, ...), given once per sha256 and
-- kept: a record's origin is `<tag>:<line>`, small enough for the state
-- entry of a record whose result left Redis to stay in Redis's smallest
-- string size.
--
-- KEYS[1]  job datasets hash  bf:{job}:datasets   (sha256 -> tag, `#` -> last tag)
-- ARGV[1]  the dataset's sha256
-- Returns the tag.
local tag = redis.call('HGET', KEYS[1], ARGV[1])
if tag then
  return tonumber(tag)
end
local n = redis.call('HINCRBY', KEYS[1], '#', 1)
redis.call('HSET', KEYS[1], ARGV[1], n)
return n
