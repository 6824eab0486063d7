-- shard.lua: a partition's provider batch shards (batch mode), atomically.
--
-- KEYS[1]  partition stream        bf:{job:pN}:tasks
-- KEYS[2]  partition state hash    bf:{job:pN}:state
-- KEYS[3]  partition shards hash   bf:{job:pN}:shards: shard id -> its JSON
-- KEYS[4]  the shard's task hash   bf:{job:pN}:shard:<id>: record id -> task
-- KEYS[5]  the shard's packed set  bf:{job:pN}:shard:<id>:packed: every
--          record id packed into it (its answers are joined on them)
-- ARGV[1]  the verb:
--
-- `pack`  ARGV[2] consumer group, ARGV[3] consumer, ARGV[4] at most this
--         many entries, ARGV[5] the shard id, ARGV[6] the shard's JSON
--         (passed through), ARGV[7] at most this many online tasks
--         delivered (the consumer's free slots: the others go back to the
--         stream's end, still queued). Reads new entries of the stream for the
--         consumer here, in the script (`XREADGROUP`): no entry is ever
--         delivered without a place. A task marked online (its encoding
--         starts `{"online":true,`, or `{"rid":"…","online":true,` as a
--         promoted retry holds it) stays pending for the consumer: it is
--         returned, for an online call. Every other entry is acknowledged
--         and deleted: the task of a record still `queued` goes into the
--         shard's hash (the record becomes `batched`); a late copy of a
--         settled record is only dropped. The shard is registered when it
--         holds a task. Returns {tasks moved, then per online entry: entry
--         id, record id, task}.
-- `cas`   ARGV[2] shard id, ARGV[3] its JSON as read, ARGV[4] the new JSON:
--         replaced only if unchanged since read. Returns 1, else 0.
-- `release` ARGV[2] shard id, then record ids: each one the shard still
--         holds goes back to the stream as a new entry (not an attempt: its
--         batch never answered it), the record `queued` again. Returns how
--         many went back.
local stream, states, shards, held = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local verb = ARGV[1]
if verb == 'cas' then
  local now = redis.call('HGET', shards, ARGV[2])
  if now ~= ARGV[3] then
    return 0
  end
  redis.call('HSET', shards, ARGV[2], ARGV[4])
  return 1
end
if verb == 'release' then
  local n = 0
  for i = 3, #ARGV do
    local rid = ARGV[i]
    local task = redis.call('HGET', held, rid)
    if task then
      redis.call('HDEL', held, rid)
      if redis.call('HGET', states, rid) == 'batched' then
        redis.call('XADD', stream, '*', 'rid', rid, 'task', task)
        redis.call('HSET', states, rid, 'queued')
        n = n + 1
      end
    end
  end
  return n
end
if verb ~= 'pack' then
  return redis.error_reply('shard.lua: unknown verb ' .. tostring(verb))
end
local read = redis.call('XREADGROUP', 'GROUP', ARGV[2], ARGV[3], 'COUNT', tonumber(ARGV[4]), 'STREAMS', stream, '>')
local out, moved, gone = {0}, 0, {}
local online, max_online = 0, tonumber(ARGV[7])
if read then
  for _, entry in ipairs(read[1][2]) do
    local id, fields = entry[1], entry[2]
    local rid, task
    for f = 1, #fields, 2 do
      if fields[f] == 'rid' then
        rid = fields[f + 1]
      elseif fields[f] == 'task' then
        task = fields[f + 1]
      end
    end
    -- An entry of an old version (one field per item) is run online too.
    local is_online = not task or string.sub(task, 1, 15) == '{"online":true,'
      or string.find(task, '^{"rid":"[^"]*","online":true,')
    if is_online and task and online >= max_online then
      redis.call('XADD', stream, '*', 'rid', rid, 'task', task)
      gone[#gone + 1] = id
    elseif is_online then
      online = online + 1
      out[#out + 1] = id
      out[#out + 1] = rid
      out[#out + 1] = task or ''
    else
      gone[#gone + 1] = id
      if rid and task and redis.call('HGET', states, rid) == 'queued' then
        redis.call('HSET', held, rid, task)
        redis.call('SADD', KEYS[5], rid)
        redis.call('HSET', states, rid, 'batched')
        moved = moved + 1
      end
    end
  end
end
if #gone > 0 then
  redis.call('XACK', stream, ARGV[2], unpack(gone))
  redis.call('XDEL', stream, unpack(gone))
end
if moved > 0 then
  redis.call('HSET', shards, ARGV[5], ARGV[6])
end
out[1] = moved
return out
