-- review_action.lua: a person's decision on a review entry, atomically.
--
-- The entry must still be in review and unchanged since the reviewer read it
-- (its JSON is compared byte for byte): of two reviewers acting on the same
-- entry, exactly one wins. The entry, with the action appended, moves to the
-- partition's archive of reviewed entries.
--
-- KEYS[1]  partition state hash     bf:{job:pN}:state
-- KEYS[2]  partition review hash    bf:{job:pN}:review
-- KEYS[3]  partition archive hash   bf:{job:pN}:reviewed
-- KEYS[4]  partition results hash   bf:{job:pN}:results
-- KEYS[5]  partition stream         bf:{job:pN}:tasks
-- KEYS[6]  partition sink stream    bf:{job:pN}:sink (see finish.lua): an
--          accepted result (`k` r) or a rejection (`k` f) is handed to the sink
-- ARGV[1]  record_id
-- ARGV[2]  the entry JSON as the reviewer read it
-- ARGV[3]  the entry JSON with this action appended (archived)
-- ARGV[4]  action: accept | requeue | reject
-- ARGV[5]  accept: the encoded result; requeue: the encoded task of the new
--          round; reject: the reason (all passed through unread)
-- Returns: 1 when applied; 0 when the entry was gone or changed (another
--          reviewer acted first); -1 when the record already has a result.
local states, review, archive, results, stream = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local rid, seen, after, action, value = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if redis.call('HGET', states, rid) ~= 'review' or redis.call('HGET', review, rid) ~= seen then
  return 0
end
if action == 'accept' then
  if redis.call('HSETNX', results, rid, value) == 0 then
    return -1
  end
  redis.call('HSET', states, rid, 'done')
elseif action == 'requeue' then
  redis.call('XADD', stream, '*', 'rid', rid, 'task', value)
  redis.call('HSET', states, rid, 'queued')
elseif action == 'reject' then
  redis.call('HSET', states, rid, 'dropped:rejected')
else
  return redis.error_reply('review_action.lua: unknown action ' .. tostring(action))
end
if action ~= 'requeue' and redis.call('EXISTS', KEYS[6]) == 1 then
  redis.call('XADD', KEYS[6], '*', 'rid', rid, 'k', action == 'accept' and 'r' or 'f')
end
redis.call('HDEL', review, rid)
redis.call('HSET', archive, rid, after)
return 1
