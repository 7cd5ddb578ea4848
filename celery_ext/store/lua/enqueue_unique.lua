-- enqueue_unique: append a unique job to the back of its job queue unless a job
-- with the same unique key is already pending (queued or scheduled).
-- KEYS[1]  lock                         {ns}:unique:<digest>
-- KEYS[2]  job queue list               {ns}:queue:<name> (a keyed job: of its fair key, include/fair.lua)
-- KEYS[3]  ready set                    {ns}:ready
-- KEYS[4]  known queues set             {ns}:queues
-- KEYS[5]  job index hash               {ns}:jobs
-- KEYS[6]  finished index entries       {ns}:jobs_done
-- KEYS[7]  (optional) publish marker    {ns}:published:<id>, one per publish call
-- ARGV[1]  message payload (kombu JSON)
-- ARGV[2]  queue name
-- ARGV[3]  wake channel                 {ns}:wake
-- ARGV[4]  queue expiry in ms (x-expires), 0 = never
-- ARGV[5]  job index TTL of finished entries in ms, "0" = no index (include/job_index.lua)
-- ARGV[6]  lock value: the job's task id, and for a job locked until finished a newline
--          and its delivery tag (include/unique.lua)
-- ARGV[7]  lock TTL in ms (the safety net if the lock is never released)
-- ARGV[8]  "1" = enqueue even if the lock is held (a retry), else "0"
-- ARGV[9]  (with KEYS[7]) marker TTL in ms
-- The lock is released by the worker when the job starts (unique_release), or for a
-- job locked until finished by the script of its final move (ack, dead, forget).
-- Returns {1, task id} when enqueued, {0, holder's task id} when a job with the same key is
-- pending (nothing pushed; the same task id published twice counts as pending),
-- {0, task id} when the publish marker was there already: a retry of a publish
-- that pushed its job (nothing pushed again; the marker's TTL is renewed, so the WAIT
-- that follows covers the first attempt's write, as in enqueue.lua).
-- @include clock
-- @include fair
local lockKey, queueKey, readyKey, queuesKey, markerKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[7]
local payload, queueName, wakeChannel = ARGV[1], ARGV[2], ARGV[3]
local expiresMs, indexTtl, lockValue, lockTtlMs, force = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], ARGV[7], ARGV[8]
local markerTtlMs = ARGV[9]
-- @include job_index
-- @include delivery_tag
-- @include announce
-- @include unique
local taskId = unique_holder(lockValue)
if markerKey then
  local pushed = redis.call('GET', markerKey)
  if pushed then
    redis.call('PEXPIRE', markerKey, markerTtlMs)
    return {0, pushed}
  end
end
local holder = redis.call('GET', lockKey)
if holder and force ~= '1' then
  return {0, unique_holder(holder)}
end
if not holder or unique_holder(holder) == taskId then
  redis.call('SET', lockKey, lockValue, 'PX', lockTtlMs)
end
push_new(queueKey, payload, readyKey, queuesKey, wakeChannel, queueName, KEYS[5], taskId,
         indexTtl, expiresMs)
if markerKey then
  redis.call('SET', markerKey, taskId, 'PX', markerTtlMs)
end
return {1, taskId}
