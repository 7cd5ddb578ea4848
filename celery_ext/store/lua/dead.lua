#!lua flags=allow-oom
-- dead: move one job from a pool's in-flight record into the dead set, with why.
-- KEYS[1]  in-flight hash of the pool   {ns}:inflight:<pool id>
-- KEYS[2]  dead zset                    {ns}:dead
-- KEYS[3]  dead jobs hash               {ns}:dead_jobs
-- KEYS[4]  redelivery hash              {ns}:redelivery
-- KEYS[5]  running counts hash          {ns}:running
-- KEYS[6]  concurrency limits hash      {ns}:limits
-- KEYS[7]  ready set                    {ns}:ready
-- KEYS[8]  job index hash               {ns}:jobs
-- KEYS[9]  finished index entries       {ns}:jobs_done
-- KEYS[10] (optional) unique lock of a job locked until finished {ns}:unique:<digest>:
--          deleted if this message holds it (include/unique.lua)
-- ARGV[1]  delivery tag (becomes the dead job id)
-- ARGV[2]  meta JSON (reason, error, pool, ...), one line
-- ARGV[3]  max dead jobs kept
-- ARGV[4]  max age of dead jobs, ms
-- ARGV[5]  optional "<queue>\n<payload>" to record when the tag is not in flight
--          (a job acked when it started, acks_late off, that then failed)
-- ARGV[6]  wake channel                 {ns}:wake (as in ack: a job queue at its
--          max_concurrency that drops below it wakes idle pools)
-- ARGV[7]  job index TTL of finished entries in ms, "0" = no index (include/job_index.lua):
--          the entry says dead unless it names another copy of the job; jobs trimmed
--          from the dead set lose theirs
-- ARGV[8]  (optional) cursor key prefix {ns}:cursor: (include/cursor.lua): a dead job
--          keeps no cursor (retried from the dead set, it starts over)
-- Returns 1 if moved, 0 if the tag was not in flight and no record was given
-- (already moved: idempotent). The dead job's id is the tag, with "~<n>" added
-- if that id is already dead (include/dead_set.lua, which also orders jobs that die in
-- the same millisecond and trims the oldest first).
local indexTtl = tonumber(ARGV[7] or 0) or 0
-- @include clock
-- @include job_index
-- @include fair
-- @include dead_set
-- @include cursor
-- @include unique
local rec = redis.call('HGET', KEYS[1], ARGV[1])
local inflight = rec ~= false
if rec then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[4], ARGV[1])
  local qname = string.sub(rec, 1, string.find(rec, '\n', 1, true) - 1)
  local n = redis.call('HINCRBY', KEYS[5], qname, -1)
  fair_release(KEYS[5], qname, rec)
  local limit = tonumber(redis.call('HGET', KEYS[6], qname))
  if limit and n == limit - 1 and redis.call('SISMEMBER', KEYS[7], qname) == 1 then
    redis.call('PUBLISH', ARGV[6], qname)
  end
elseif ARGV[5] and ARGV[5] ~= '' then
  rec = ARGV[5]
else
  return 0
end
local id = dead_add(KEYS[2], KEYS[3], ARGV[1], ARGV[2] .. '\n' .. rec)
cursor_drop(ARGV[8], jix_payload_after(rec, 1), nil)
if indexTtl > 0 then
  local nl = string.find(rec, '\n', 1, true)
  local tid = jix_task_id(string.sub(rec, nl + 1))
  -- Not in flight (acked when it started): the entry may say done already.
  if not inflight or jix_owns(KEYS[8], tid, ARGV[1]) then
    local reason = string.match(ARGV[2], '"reason": *"([^"]*)"') or ''
    jix_set(KEYS[8], tid, 'dead', string.sub(rec, 1, nl - 1), id, reason)
  end
end
dead_trim(KEYS[2], KEYS[3], KEYS[8], indexTtl, tonumber(ARGV[3]), tonumber(ARGV[4]))
if KEYS[10] then unique_release_tags({KEYS[10]}, {[ARGV[1]] = true}) end
return 1
