-- enqueue: append one job to the back of its job queue and wake idle pools.
-- KEYS[1]  job queue list            {ns}:queue:<name> (a keyed job: of its fair key, include/fair.lua)
-- KEYS[2]  ready set                 {ns}:ready
-- KEYS[3]  known queues set          {ns}:queues (job queues only)
-- KEYS[4]  job index hash            {ns}:jobs
-- KEYS[5]  finished index entries    {ns}:jobs_done
-- KEYS[6]  (optional) publish marker {ns}:published:<id>, one per publish call
-- ARGV[1]  message payload (kombu JSON)
-- ARGV[2]  queue name
-- ARGV[3]  wake channel              {ns}:wake
-- ARGV[4]  queue expiry in ms (x-expires), 0 = never
-- ARGV[5]  job index TTL of finished entries in ms, "0" = no index (include/job_index.lua)
-- ARGV[6]  (with KEYS[6]) marker TTL in ms
-- KEYS[7]  (optional, after KEYS[6]) a periodic entry's run record in this copy
--          {ns}:periodic_pushed:<entry> (cluster: the latest due time of the entry pushed)
-- ARGV[7]  (with KEYS[7]) the run's due time (ms)
-- ARGV[8]  (with KEYS[7]) the run record's TTL in ms
-- Kombu's remote-control replies (queues named "<id>.reply.<mailbox>.pidbox", one per
-- `celery inspect`/`control` call) use the same path but are not job queues: they are
-- not recorded in the known queues set (queue_info.lua drops such names too).
-- Returns the queue length after the push, or -1 when the publish marker was there
-- already (a retry of a publish whose write landed: nothing pushed again; the marker's
-- TTL is renewed, a write that replicates after the first attempt's, so the WAIT that
-- follows on this connection covers that write: see publish.py) or the run record holds
-- the run's due time or a later one (another leader pushed it).
-- @include clock
-- @include fair
local queueKey, readyKey, queuesKey, markerKey = KEYS[1], KEYS[2], KEYS[3], KEYS[6]
local payload, queueName, wakeChannel = ARGV[1], ARGV[2], ARGV[3]
local expiresMs, indexTtl, markerTtlMs = tonumber(ARGV[4]), tonumber(ARGV[5] or 0) or 0, ARGV[6]
-- @include job_index
-- @include delivery_tag
-- @include announce
local runRecordKey, runDueMs, runRecordTtlMs = KEYS[7], ARGV[7], ARGV[8]
if runRecordKey and tonumber(redis.call('GET', runRecordKey) or '-1') >= tonumber(runDueMs) then
  return -1
end
if markerKey and not redis.call('SET', markerKey, '1', 'NX', 'PX', markerTtlMs) then
  redis.call('PEXPIRE', markerKey, markerTtlMs)
  return -1
end
if runRecordKey then redis.call('SET', runRecordKey, runDueMs, 'PX', runRecordTtlMs) end
local jobId = nil  -- (a remote-control reply is not a job: not indexed)
if indexTtl > 0 and string.sub(queueName, -7) ~= '.pidbox' then
  jobId = jix_task_id(payload)
end
return push_new(queueKey, payload, readyKey, queuesKey, wakeChannel, queueName, KEYS[4],
                jobId, indexTtl, expiresMs)
