-- retry_record.lua: start a new round of attempts for one record, atomically,
-- if it is still in the state the operator saw.
--
-- KEYS[1]  partition stream        bf:{job:pN}:tasks
-- KEYS[2]  partition state hash    bf:{job:pN}:state
-- ARGV[1]  record_id
-- ARGV[2]  the state it must still be in
-- ARGV[3]  the encoded task of the new round (passed through unread)
-- Returns: 1 when re-queued, 0 when its state had changed.
local stream, states = KEYS[1], KEYS[2]
local rid = ARGV[1]
if redis.call('HGET', states, rid) ~= ARGV[2] then
  return 0
end
redis.call('XADD', stream, '*', 'rid', rid, 'task', ARGV[3])
redis.call('HSET', states, rid, 'queued')
return 1
