-- schedule: store a job with a future due time in the scheduled (or retry) set,
-- optionally as a unique job, and wake requeuers if it is now the earliest.
-- KEYS[1]  target zset                  {ns}:scheduled or {ns}:retry
-- KEYS[2]  scheduled jobs hash          {ns}:scheduled_jobs
-- KEYS[3]  the other zset               {ns}:retry or {ns}:scheduled
-- KEYS[4]  known queues set             {ns}:queues
-- KEYS[5]  job index hash               {ns}:jobs
-- KEYS[6]  finished index entries       {ns}:jobs_done
-- KEYS[7]  (unique jobs only) lock      {ns}:unique:<digest>
-- KEYS[7 or 8, after the lock if any] (optional) publish marker {ns}:published:<id>
-- ARGV[1]  job id (delivery tag)
-- ARGV[2]  delay in ms from now (Redis time)
-- ARGV[3]  meta JSON object (one line); "scheduled_at" is added here
-- ARGV[4]  queue name
-- ARGV[5]  message payload (kombu JSON)
-- ARGV[6]  schedule channel             {ns}:schedule
-- ARGV[7]  job index TTL of finished entries in ms, "0" = no index (include/job_index.lua)
-- ARGV[8]  the job's task id (its index entry says scheduled or retry)
-- ARGV[9]  (unique) lock value: the job's task id, and for a job locked until finished or
--          debounced a newline and its delivery tag (include/unique.lua); "" = not unique
-- ARGV[10] (unique) lock TTL in ms, counted from the due time
-- ARGV[11] (unique) "1" = schedule even if the lock is held (a retry); "d" = debounce: a
--          holder still waiting in this set is replaced by this job (its record, index
--          entry and lock, in this call); "0" = otherwise
-- ARGV[12] (with the marker) marker TTL in ms
-- KEYS[last, after the marker] (with ARGV[13]) a periodic entry's run record in this copy
--          {ns}:periodic_pushed:<entry> (the latest due time of the entry written)
-- ARGV[13] (optional, with the marker) the periodic run's due time (ms)
-- ARGV[14] (with ARGV[13]) the run record's TTL in ms
-- Returns {1, due ms, task id} when scheduled (a debounced job also when it replaced the
-- holder), {0, 0, holder's task id} when a unique job
-- with the same key is already pending (nothing stored; the same task id
-- published twice counts as pending), {0, 0, marker value} when the publish marker
-- was there already: a retry of a publish that stored its job (nothing stored again;
-- the marker's TTL is renewed, so the WAIT that follows covers the first attempt's
-- write, as in enqueue.lua), {0, 0, ""} when the run record holds the run's due time or
-- a later one (another leader stored it).
local targetKey, jobsKey, otherKey, queuesKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local jobId, delayMs, metaJson, queueName = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local payload, scheduleChannel = ARGV[5], ARGV[6]
local indexTtl, indexId = tonumber(ARGV[7]), ARGV[8]
local lockValue, lockTtlMs, force, markerTtlMs = ARGV[9] or '', ARGV[10], ARGV[11], ARGV[12]
local runDueMs, runRecordTtlMs = ARGV[13], ARGV[14]
local runRecordKey = runDueMs and KEYS[#KEYS] or nil
local lockKey, markerKey = nil, nil
-- @include unique
local taskId = unique_holder(lockValue)
if taskId ~= '' then
  lockKey, markerKey = KEYS[7], KEYS[8]
else
  markerKey = KEYS[7]
end
-- @include clock
-- @include job_index
if runRecordKey and tonumber(redis.call('GET', runRecordKey) or '-1') >= tonumber(runDueMs) then
  return {0, 0, ''}
end
if markerKey then
  local stored = redis.call('GET', markerKey)
  if stored then
    redis.call('PEXPIRE', markerKey, markerTtlMs)
    return {0, 0, stored}
  end
end
local now = clock_ms()
local due = now + delayMs
if lockKey then
  local holder = redis.call('GET', lockKey)
  if holder and force == 'd' and unique_holder(holder) ~= taskId then
    -- Debounce: a holder still waiting here gives way to this job.
    local old = unique_tag(holder)
    local rec = old ~= '' and redis.call('ZSCORE', targetKey, old) and redis.call('HGET', jobsKey, old)
    if rec then
      redis.call('ZREM', targetKey, old)
      redis.call('HDEL', jobsKey, old)
      if indexTtl > 0 then jix_drop(KEYS[5], unique_holder(holder), nil, old) end
      holder = false
    end
  end
  if holder and force ~= '1' then
    return {0, 0, unique_holder(holder)}
  end
  if not holder or unique_holder(holder) == taskId then
    redis.call('SET', lockKey, lockValue, 'PX', delayMs + tonumber(lockTtlMs))
  end
end
local meta = cjson.decode(metaJson)
meta['scheduled_at'] = now
-- The earliest due time before this job, over both sets.
local earliest = nil
for _, k in ipairs({targetKey, otherKey}) do
  local head = redis.call('ZRANGE', k, 0, 0, 'WITHSCORES')
  if head[2] and (not earliest or tonumber(head[2]) < earliest) then
    earliest = tonumber(head[2])
  end
end
redis.call('HSET', jobsKey, jobId, cjson.encode(meta) .. '\n' .. queueName .. '\n' .. payload)
redis.call('ZADD', targetKey, due, jobId)
redis.call('SADD', queuesKey, queueName)
if indexTtl > 0 and indexId ~= '' then
  local state = string.sub(targetKey, -7) == '}:retry' and 'retry' or 'scheduled'
  jix_set(KEYS[5], indexId, state, queueName, jobId, due)
end
if markerKey then
  redis.call('SET', markerKey, taskId ~= '' and taskId or '1', 'PX', markerTtlMs)
end
if runRecordKey then redis.call('SET', runRecordKey, runDueMs, 'PX', runRecordTtlMs) end
if not earliest or due < earliest then
  redis.call('PUBLISH', scheduleChannel, due)
end
return {1, due, taskId}
