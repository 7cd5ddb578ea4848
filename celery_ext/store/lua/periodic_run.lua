-- periodic_run: enqueue one run of a periodic job entry and record it on the entry, or
-- only move the entry's next due time on (a paused, skipped or unpublishable due time).
-- Called by the periodic leader's producer (worker/periodic_leader.py); a due time is
-- enqueued once however many leaders call.
-- KEYS[1]  entry state hash          {ns}:periodic:<name>
-- KEYS[2]  (with a payload) job queue list   {ns}:queue:<queue>
-- KEYS[3]  (with a payload) ready set        {ns}:ready
-- KEYS[4]  (with a payload) known queues set {ns}:queues
-- ARGV[1]  the entry's next due time (ms) this call was planned from; the call does
--          nothing unless the state still says it. "" = a run-now, outside the schedule
-- ARGV[2]  the run's due time (ms; 0 for a run-now)
-- ARGV[3]  next due time to record (ms); "" = unchanged (run-now)
-- ARGV[4]  due times this call passes over without a run of their own (missed, paused)
-- ARGV[5]  the run's job id (deterministic per entry and due time)
-- ARGV[6]  the entry's spec (task, schedule, time zone) the call was planned under; the
--          call does nothing unless the state's spec still says it (a schedule changed,
--          or the entry removed, since the leader read it). "" = no check (a run-now)
-- ARGV[7]  message payload (kombu JSON); "" = no run, only move next_due on
-- ARGV[8]  queue name
-- ARGV[9]  wake channel              {ns}:wake
-- ARGV[10] queue expiry in ms (x-expires), 0 = never
-- KEYS[5]  (with a payload) job index hash          {ns}:jobs
-- KEYS[6]  (with a payload) finished index entries  {ns}:jobs_done
-- ARGV[11] (optional) why this due time has no run, kept as the entry's error
-- ARGV[12] (with a payload) job index TTL of finished entries in ms, "0" = no index
-- ARGV[13] (without a payload, optional) "1" = the caller pushed the run itself, in its
--          job queue's copy under a publish marker of this job id (a cluster: the queue
--          is in another slot, docs/cluster.md): record it as a run, as with a payload
-- Returns 1 when the job was pushed; 2 when this job id is the entry's last run already
-- (Kombu retried a publish whose write landed: nothing pushed again); 0 when the entry
-- moved on meanwhile (another leader took this due time); -1 when the entry is paused
-- (next_due moved on, nothing pushed); -2 when next_due moved on without a run as asked.
-- @include clock
-- @include fair
local stateKey, queueKey, readyKey, queuesKey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local expected, dueMs, nextMs, passed, jobId = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local spec = ARGV[6]
local payload, queueName, wakeChannel, expiresMs = ARGV[7], ARGV[8], ARGV[9], tonumber(ARGV[10])
local err = ARGV[11] or ''
local pushedByCaller = payload == '' and ARGV[13] == '1'
local indexTtl = tonumber(ARGV[12] or 0) or 0
-- @include job_index
-- @include delivery_tag
-- @include announce

if (payload ~= '' or pushedByCaller) and redis.call('HGET', stateKey, 'last_job_id') == jobId then
  return 2
end
local scheduled = expected ~= ''
if scheduled and redis.call('HGET', stateKey, 'next_due') ~= expected then
  return 0
end
if spec ~= '' and redis.call('HGET', stateKey, 'spec') ~= spec then
  return 0  -- planned under a schedule the entry no longer has
end
local paused = redis.call('HGET', stateKey, 'paused') == '1'
if (payload == '' and not pushedByCaller) or (payload ~= '' and paused and scheduled) then
  redis.call('HSET', stateKey, 'next_due', nextMs, 'error', err)
  if payload ~= '' then passed = passed + 1 end
  if passed > 0 then redis.call('HINCRBY', stateKey, 'missed', passed) end
  if payload == '' then return -2 end
  return -1
end

if not pushedByCaller then
  push_new(queueKey, payload, readyKey, queuesKey, wakeChannel, queueName, KEYS[5], jobId,
           indexTtl, expiresMs)
end
local now = clock_ms()
if scheduled then
  redis.call('HSET', stateKey, 'next_due', nextMs, 'last_due', dueMs)
else
  redis.call('HDEL', stateKey, 'last_due')
end
redis.call('HSET', stateKey, 'last_run_at', now, 'last_job_id', jobId, 'error', '')
redis.call('HINCRBY', stateKey, 'runs', 1)
if passed > 0 then redis.call('HINCRBY', stateKey, 'missed', passed) end
return 1
