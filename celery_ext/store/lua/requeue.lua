#!lua flags=allow-oom
-- requeue: move jobs from a pool's in-flight record back to the FRONT of their
-- job queues (reject with requeue, restore at shutdown), each to the list of its
-- priority level: ahead of the jobs of its level.
-- KEYS[1]  in-flight hash of the pool   {ns}:inflight:<pool id>
-- KEYS[2]  ready set                    {ns}:ready
-- KEYS[3]  redelivery hash              {ns}:redelivery
-- KEYS[4]  running counts hash          {ns}:running
-- KEYS[5]  job index hash               {ns}:jobs
-- KEYS[6]  finished index entries       {ns}:jobs_done
-- KEYS[7..] job queue lists, one per tag: the list of the job's priority level
--          (a job with a fair key goes to its key's sub-queue of that queue instead, include/fair.lua)
-- ARGV[1]  wake channel                 {ns}:wake
-- ARGV[2]  job queue key prefix         {ns}:queue:
-- ARGV[3]  job index TTL of finished entries in ms, "0" = no index (include/job_index.lua)
-- ARGV[4..] delivery tags, one per KEYS[7..], in the order to push them
--          (the last one pushed is the next fetched)
-- A job's index entry (when it still names this copy in flight: include/job_index.lua's
-- jix_owns) says queued again, with the tag its next fetch records.
-- The caller reads each job's priority from its payload (priority.py). Each job is
-- marked redelivered (recovery count kept, or 0). A tag whose
-- record is gone, or whose record names another queue than the key given, is
-- skipped: the caller passes the queue it read, and this script re-checks it.
-- Returns the tags requeued.

-- @include clock
-- @include priority
local indexTtl = tonumber(ARGV[3])
-- @include job_index
-- @include delivery_tag
-- @include fair
local done = {}
for i = 7, #KEYS do
  local tag = ARGV[i - 3]
  local rec = redis.call('HGET', KEYS[1], tag)
  if rec then
    local nl = string.find(rec, '\n', 1, true)
    local qname = string.sub(rec, 1, nl - 1)
    if is_level_of(KEYS[i], ARGV[2] .. qname) then
      push_front(ARGV[2] .. qname, KEYS[i], string.sub(rec, nl + 1))
      redis.call('HDEL', KEYS[1], tag)
      redis.call('HINCRBY', KEYS[4], qname, -1)
      fair_release(KEYS[4], qname, rec)
      redis.call('HSETNX', KEYS[3], tag, 0)
      if indexTtl > 0 then
        local payload = string.sub(rec, nl + 1)
        local id = jix_task_id(payload)
        if jix_owns(KEYS[5], id, tag) then
          jix_set(KEYS[5], id, 'queued', qname, jix_level(KEYS[i]), tag_of(payload))
        end
      end
      if redis.call('SADD', KEYS[2], qname) == 1 then
        redis.call('PUBLISH', ARGV[1], qname)
      end
      done[#done + 1] = tag
    end
  end
end
return done
