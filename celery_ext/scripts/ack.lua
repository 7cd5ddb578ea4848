-- ack: a pool is done with jobs; drop them from its in-flight record.
-- KEYS[1]  in-flight hash of the pool   {ns}:inflight:<pool id>
-- KEYS[2]  redelivery hash              {ns}:redelivery
-- KEYS[3]  running counts hash          {ns}:running
-- ARGV[1..] delivery tags
-- A tag no longer in the record (its pool was reaped and the job requeued) is
-- ignored, so a late ack from a pool that came back never touches the new copy.
-- Returns how many tags were removed.
local removed = 0
for i = 1, #ARGV do
  local rec = redis.call('HGET', KEYS[1], ARGV[i])
  if rec then
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('HDEL', KEYS[2], ARGV[i])
    redis.call('HINCRBY', KEYS[3], string.sub(rec, 1, string.find(rec, '\n', 1, true) - 1), -1)
    removed = removed + 1
  end
end
return removed
