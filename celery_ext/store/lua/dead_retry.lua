-- dead_retry: move dead jobs back to the FRONT of their job queues (manual retry).
-- KEYS[1]  dead zset                    {ns}:dead
-- KEYS[2]  dead jobs hash               {ns}:dead_jobs
-- KEYS[3]  ready set                    {ns}:ready
-- KEYS[4]  known queues set             {ns}:queues
-- KEYS[5]  job index hash               {ns}:jobs
-- KEYS[6]  finished index entries       {ns}:jobs_done
-- KEYS[7..] job queue lists, one per job: the list of the job's priority level,
--          read by the caller from its payload (priority.py); a job with a fair key
--          goes to its key's sub-queue of that queue instead (include/fair.lua)
-- ARGV[1]  wake channel                 {ns}:wake
-- ARGV[2]  job queue key prefix         {ns}:queue:
-- ARGV[3]  job index TTL of finished entries in ms, "0" = no index (include/job_index.lua)
-- ARGV[4..] three values per job, in the order of KEYS[7..]: dead job id, SHA1 of
--          the dead record the caller read, payload to enqueue (the caller's
--          rewrite of it: attempts reset, marked as a manual retry)
-- A job whose record is gone (retried or deleted by someone else) or changed
-- since the caller read it is skipped, so pressing "retry" twice requeues once.
-- Returns the ids requeued.
-- @include clock
-- @include priority
local indexTtl = tonumber(ARGV[3])
-- @include job_index
-- @include delivery_tag
-- @include fair
local done = {}
for i = 7, #KEYS do
  local j = 4 + (i - 7) * 3
  local id = ARGV[j]
  local rec = redis.call('HGET', KEYS[2], id)
  if rec and redis.sha1hex(rec) == ARGV[j + 1] then
    local nl1 = string.find(rec, '\n', 1, true)
    local nl2 = string.find(rec, '\n', nl1 + 1, true)
    local qname = string.sub(rec, nl1 + 1, nl2 - 1)
    if is_level_of(KEYS[i], ARGV[2] .. qname) then
      redis.call('ZREM', KEYS[1], id)
      redis.call('HDEL', KEYS[2], id)
      push_front(ARGV[2] .. qname, KEYS[i], ARGV[j + 2])
      if indexTtl > 0 then
        local tid = jix_task_id(ARGV[j + 2])
        if jix_is(KEYS[5], tid, 'dead', id) then
          jix_set(KEYS[5], tid, 'queued', qname, jix_level(KEYS[i]), tag_of(ARGV[j + 2]))
        end
      end
      redis.call('SADD', KEYS[4], qname)
      if redis.call('SADD', KEYS[3], qname) == 1 then
        redis.call('PUBLISH', ARGV[1], qname)
      end
      done[#done + 1] = id
    end
  end
end
return done
