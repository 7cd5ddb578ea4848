-- forget: delete jobs from the scheduled/retry sets or from the dead set for good,
-- releasing the unique-job lock each of them still holds, in one atomic step (so an
-- identical job may be enqueued at once instead of after the lock's TTL).
-- KEYS[1]  job records hash             {ns}:scheduled_jobs or {ns}:dead_jobs
-- KEYS[2]  first zset                   {ns}:scheduled or {ns}:dead
-- KEYS[3]  second zset                  {ns}:retry (or {ns}:dead again)
-- KEYS[4]  job index hash               {ns}:jobs
-- KEYS[5]  finished index entries       {ns}:jobs_done
-- KEYS[6..] unique locks                {ns}:unique:<digest>, one per unique job
-- ARGV[1]  job index TTL of finished entries in ms, "0" = no index (include/job_index.lua):
--          a deleted job's entry goes too, unless it names another copy of the job
-- ARGV[2..] four values per job: job id, SHA1 of the record the caller read, index
--          in KEYS of its unique lock (0: not a unique job) and its task id (the
--          lock's value while this job holds it, include/unique.lua)
-- A job whose record is gone (deleted, promoted or retried meanwhile) or changed
-- since the caller read it is skipped; a lock now held by another job is kept.
-- Returns {deleted ids, changed ids} (the caller reads the changed ones again).
local recordsKey, firstSet, secondSet = KEYS[1], KEYS[2], KEYS[3]
local indexTtl = tonumber(ARGV[1])
-- @include clock
-- @include job_index
-- @include unique
local deleted, changed = {}, {}
for j = 2, #ARGV, 4 do
  local id, digest, lockIndex, taskId = ARGV[j], ARGV[j + 1], tonumber(ARGV[j + 2]), ARGV[j + 3]
  local rec = redis.call('HGET', recordsKey, id)
  if rec and redis.sha1hex(rec) ~= digest then
    changed[#changed + 1] = id
  elseif rec then
    local removed = redis.call('ZREM', firstSet, id)
    if secondSet ~= firstSet then
      removed = removed + redis.call('ZREM', secondSet, id)
    end
    redis.call('HDEL', recordsKey, id)
    if indexTtl > 0 then
      jix_drop(KEYS[4], jix_task_id(jix_payload_after(rec, string.find(rec, '\n', 1, true) + 1)), nil, id)
    end
    if removed > 0 then
      deleted[#deleted + 1] = id
    end
    local lockValue = lockIndex > 0 and redis.call('GET', KEYS[lockIndex])
    if lockValue and unique_holder(lockValue) == taskId then
      redis.call('DEL', KEYS[lockIndex])
    end
  end
end
return {deleted, changed}
