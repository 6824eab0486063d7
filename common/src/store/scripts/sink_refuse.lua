-- A done record whose row the sink's database refused (a constraint of the
-- user's own) goes back to review, with the database's message: its result
-- leaves Redis (the review entry holds the output), and the record is handed
-- to the sink again as a failure, so the failures table says `review`.
--
-- KEYS[1]  partition state hash    bf:{job:pN}:state
-- KEYS[2]  partition results hash  bf:{job:pN}:results
-- KEYS[3]  partition review hash   bf:{job:pN}:review
-- KEYS[4]  partition sink stream   bf:{job:pN}:sink
-- ARGV[1]  record_id
-- ARGV[2]  the encoded review entry (passed through unread)
-- Returns 1 when the record moved to review, 0 when it was no longer a done
-- record with its result in Redis (nothing done).
local states, results, review, sink = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local rid = ARGV[1]
if redis.call('HGET', states, rid) ~= 'done' or redis.call('HDEL', results, rid) == 0 then
  return 0
end
redis.call('HSET', review, rid, ARGV[2])
redis.call('HSET', states, rid, 'review')
redis.call('XADD', sink, '*', 'rid', rid, 'k', 'f')
return 1
