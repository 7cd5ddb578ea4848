-- enqueue_unique: append a unique job to the back of its job queue unless a job
-- with the same unique key is already pending (queued or scheduled).
-- KEYS[1]  lock                         {ns}:unique:<digest>
-- KEYS[2]  job queue list               {ns}:queue:<name>
-- KEYS[3]  ready set                    {ns}:ready
-- KEYS[4]  known queues set             {ns}:queues
-- ARGV[1]  message payload (kombu JSON)
-- ARGV[2]  queue name
-- ARGV[3]  wake channel                 {ns}:wake
-- ARGV[4]  queue expiry in ms (x-expires), 0 = never
-- ARGV[5]  lock value: the job's task id
-- ARGV[6]  lock TTL in ms (the safety net if the lock is never released)
-- ARGV[7]  "1" = enqueue even if the lock is held (a retry), else "0"
-- The lock is released by the worker when the job starts (unique_release).
-- Returns {1, task id} when enqueued, {0, holder} when a job with the same key is
-- pending (nothing pushed; the same task id published twice counts as pending).
local holder = redis.call('GET', KEYS[1])
if holder and ARGV[7] ~= '1' then
  return {0, holder}
end
if not holder or holder == ARGV[5] then
  redis.call('SET', KEYS[1], ARGV[5], 'PX', ARGV[6])
end
redis.call('LPUSH', KEYS[2], ARGV[1])
if redis.call('SADD', KEYS[3], ARGV[2]) == 1 then
  redis.call('SADD', KEYS[4], ARGV[2])
  redis.call('PUBLISH', ARGV[3], ARGV[2])
end
if tonumber(ARGV[4]) > 0 then
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
return {1, ARGV[5]}
