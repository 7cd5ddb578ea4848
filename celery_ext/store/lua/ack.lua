#!lua flags=allow-oom
-- ack: a pool is done with jobs; drop them from its in-flight record.
-- KEYS[1]  in-flight hash of the pool   {ns}:inflight:<pool id>
-- KEYS[2]  redelivery hash              {ns}:redelivery
-- KEYS[3]  running counts hash          {ns}:running
-- KEYS[4]  concurrency limits hash      {ns}:limits
-- KEYS[5]  ready set                    {ns}:ready
-- KEYS[6]  job index hash               {ns}:jobs
-- KEYS[7]  finished index entries       {ns}:jobs_done
-- KEYS[8..] unique locks of jobs locked until finished {ns}:unique:<digest>: each is
--          deleted if the message holding it is one of the tags removed here (its last
--          run ended; a retry published before this ack holds it under its own tag)
-- ARGV[1]  wake channel                 {ns}:wake
-- ARGV[2]  job index TTL of finished entries in ms, "0" = no index (include/job_index.lua)
-- ARGV[3]  cursor key prefix            {ns}:cursor: (include/cursor.lua): a finished
--          job's cursor goes with it, if this run owns it
-- ARGV[4]  pool id (the finished entry names the pool that ran the job)
-- ARGV[5..] delivery tags
-- A job's index entry says done if it names the copy in flight under the tag (queued with
-- that tag, as the fetch leaves it, or inflight with it, as a worker of an earlier
-- version wrote it: include/job_index.lua's jix_owns); an entry naming another copy (a
-- retry scheduled under its task id) is left alone. The done entry keeps the time of the
-- entry it replaces (when the run was queued).
-- A tag no longer in the record (its pool was reaped and the job requeued) is
-- ignored, so a late ack from a pool that came back never touches the new copy.
-- A job queue at its max_concurrency is skipped by fetch (and left in the ready
-- set); when an ack brings it (or one of its fair keys, include/fair.lua) just below its
-- limit, idle pools are woken.
-- Returns how many tags were removed.
-- @include clock
-- @include fair
-- @include unique
local removed = 0
local done = {}
local limited = redis.call('HLEN', KEYS[4]) > 0
local indexTtl = tonumber(ARGV[2])
-- @include job_index
-- @include cursor
for i = 5, #ARGV do
  local rec = redis.call('HGET', KEYS[1], ARGV[i])
  if rec then
    local qname = string.sub(rec, 1, string.find(rec, '\n', 1, true) - 1)
    if indexTtl > 0 then
      local id = jix_task_id(jix_payload_after(rec, 1))
      local owned, entry = jix_owns(KEYS[6], id, ARGV[i])
      if owned then
        jix_finish(KEYS[6], KEYS[7], indexTtl, id, qname, ARGV[i], ARGV[4], entry and entry[2])
      end
    end
    cursor_drop(ARGV[3], jix_payload_after(rec, 1), ARGV[i])
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('HDEL', KEYS[2], ARGV[i])
    local n = redis.call('HINCRBY', KEYS[3], qname, -1)
    local fn = fair_release(KEYS[3], qname, rec)
    if limited then
      local limit = tonumber(redis.call('HGET', KEYS[4], qname))
      local flimit = fn and tonumber(redis.call('HGET', KEYS[4], qname .. '\n'))
      if ((limit and n == limit - 1) or (flimit and fn == flimit - 1))
          and redis.call('SISMEMBER', KEYS[5], qname) == 1 then
        redis.call('PUBLISH', ARGV[1], qname)
      end
    end
    removed = removed + 1
    done[ARGV[i]] = true
  end
end
if #KEYS > 7 then unique_release_tags({unpack(KEYS, 8)}, done) end
return removed
