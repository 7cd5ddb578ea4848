#!lua flags=allow-oom
-- throttle: a job asked to wait (raise celery_ext.Throttled(seconds), worker/fate.py): it
-- goes back to the FRONT of its job queue (its fair key's sub-queue when it has a key),
-- and its fair key, or without one its whole job queue, is held for that long in all
-- pools. Not a retry nor a recovery: the redelivery hash is not touched (a recovered
-- job keeps its count, any other stays unmarked).
-- KEYS[1]  in-flight hash of the pool   {ns}:inflight:<pool id>
-- KEYS[2]  ready set                    {ns}:ready
-- KEYS[3]  running counts hash          {ns}:running
-- KEYS[4]  rate limit state hash        {ns}:rate_tat (the queue's "not due until", µs)
-- KEYS[5]  job index hash               {ns}:jobs
-- KEYS[6]  finished index entries       {ns}:jobs_done
-- KEYS[7]  the list of the job's queue and priority level (include/priority.lua; a job
--          with a fair key goes to its key's sub-queue of that queue instead)
-- ARGV[1]  wake channel                 {ns}:wake
-- ARGV[2]  job queue key prefix         {ns}:queue:
-- ARGV[3]  job index TTL of finished entries in ms, "0" = no index (include/job_index.lua)
-- ARGV[4]  delivery tag
-- ARGV[5]  how long to hold, µs
-- ARGV[6]  (optional) "<queue>\n<payload>": the job as the worker has it, pushed when
--          the tag is no longer in the record (acked when it started: acks_late off)
-- The hold: a fair key's state (include/fair.lua: fair_hold, the one its per-key rate
-- limit moves), or the queue's field in KEYS[4] (the one its rate limit moves): fetch
-- passes the key over, or skips the queue, until then, and returns the wait. A hold
-- never shortens one in place. A queue without a rate limit has its field removed by
-- the first fetch that finds the hold over.
-- Returns "key" (its fair key held), "queue" (its job queue held), or false (the tag
-- is gone from the record and no job was given, or the list given is not its queue's).

-- @include clock
-- @include priority
local indexTtl = tonumber(ARGV[3])
-- @include job_index
-- @include delivery_tag
-- @include fair
local tag = ARGV[4]
local rec = redis.call('HGET', KEYS[1], tag)
local owned = rec ~= false
if not owned then
  rec = ARGV[6]
  if not rec or rec == '' then return false end
end
local nl = string.find(rec, '\n', 1, true)
if not nl then return false end
local qname = string.sub(rec, 1, nl - 1)
local payload = string.sub(rec, nl + 1)
local qkey = ARGV[2] .. qname
if not is_level_of(KEYS[7], qkey) then return false end
push_front(qkey, KEYS[7], payload)
if owned then
  redis.call('HDEL', KEYS[1], tag)
  redis.call('HINCRBY', KEYS[3], qname, -1)
  fair_release(KEYS[3], qname, rec)
end
if indexTtl > 0 then
  local id = jix_task_id(payload)
  if not owned or jix_owns(KEYS[5], id, tag) then
    jix_set(KEYS[5], id, 'queued', qname, jix_level(KEYS[7]), tag_of(payload))
  end
end
local now = clock_us()
local due = now + tonumber(ARGV[5])
local key = fair_of(payload)
local held
if key then
  fair_hold(qkey, key, due, now)
  held = 'key'
else
  if due > (tonumber(redis.call('HGET', KEYS[4], qname)) or 0) then
    redis.call('HSET', KEYS[4], qname, string.format('%.0f', due))
  end
  held = 'queue'
end
if redis.call('SADD', KEYS[2], qname) == 1 then
  redis.call('PUBLISH', ARGV[1], qname)
end
return held
