#!lua flags=allow-oom
-- recover: return a dead (or vanished) pool's in-flight jobs to the FRONT of their
-- job queues (of the list of their priority level), counting one recovery per job;
-- a job recovered more than max_recoveries times goes to the dead set instead (a
-- poison pill). Also used for a single job whose prefork child died (the pool
-- itself is alive).
-- KEYS[1]  in-flight hash of the pool   {ns}:inflight:<pool id>
-- KEYS[2]  pools zset                   {ns}:pools
-- KEYS[3]  pool hash                    {ns}:pool:<pool id>
-- KEYS[4]  in-flight pools set          {ns}:inflight_pools
-- KEYS[5]  ready set                    {ns}:ready
-- KEYS[6]  redelivery hash              {ns}:redelivery
-- KEYS[7]  running counts hash          {ns}:running
-- KEYS[8]  dead zset                    {ns}:dead
-- KEYS[9]  dead jobs hash               {ns}:dead_jobs
-- KEYS[10] job index hash               {ns}:jobs
-- KEYS[11] finished index entries       {ns}:jobs_done
-- KEYS[12..] job queue lists, one per tag: the list of the job's priority level,
--          read by the caller from its payload (priority.py)
--          (a job with a fair key goes to its key's sub-queue of that queue instead, include/fair.lua)
-- KEYS[after the lists] unique locks of jobs locked until finished {ns}:unique:<digest>:
--          each is deleted if a job of this call that holds it goes to the dead set (a
--          job requeued keeps its lock: it runs again; include/unique.lua)
-- ARGV[1]  pool id
-- ARGV[2]  "pool": only if the pool's heartbeat is older than its own dead_after
--          (field dead_after_ms of its hash, see liveness.py) or, for a pool
--          registered without one, than ARGV[3] (or it is gone), and then the pool is
--          removed; "job": the pool is alive, recover the tags
-- ARGV[3]  fallback heartbeat deadline, ms (Redis time); ignored in "job" mode
-- ARGV[4]  wake channel                 {ns}:wake
-- ARGV[5]  job queue key prefix         {ns}:queue:
-- ARGV[6]  max recoveries
-- ARGV[7]  max dead jobs kept
-- ARGV[8]  reason/error text prefix for the dead set (e.g. "worker lost")
-- ARGV[9]  job index TTL of finished entries in ms, "0" = no index (include/job_index.lua)
-- ARGV[10] cursor key prefix            {ns}:cursor: (include/cursor.lua): a poison
--          pill keeps no cursor; a requeued job keeps its own, to resume from
-- ARGV[11..] delivery tags, one per KEYS[12..], in the order to push them
-- Returns {status, requeued tags, dead tags}; status 0 = the pool heartbeated
-- meanwhile (alive: nothing done), 1 = done.
-- @include clock
local now = clock_ms()
if ARGV[2] == 'pool' then
  local beat = redis.call('ZSCORE', KEYS[2], ARGV[1])
  local ownDeadAfter = tonumber(redis.call('HGET', KEYS[3], 'dead_after_ms'))
  local deadline = ownDeadAfter and (now - ownDeadAfter) or tonumber(ARGV[3])
  if beat and tonumber(beat) >= deadline then
    return {0, {}, {}}
  end
  -- Declared dead first: its heartbeat now fails and it re-registers; its fetches
  -- are refused until then, and its late acks find nothing.
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('DEL', KEYS[3])
end
-- @include priority
local indexTtl = tonumber(ARGV[9])
-- @include job_index
-- @include delivery_tag
-- @include fair
-- @include dead_set
-- @include unique
-- @include cursor
local cursorPrefix = ARGV[10]
local requeued, dead, deadTags = {}, {}, {}
local nTags = #ARGV - 10
for i = 12, 11 + nTags do
  local tag = ARGV[i - 1]
  local rec = redis.call('HGET', KEYS[1], tag)
  if rec then
    local nl = string.find(rec, '\n', 1, true)
    local qname = string.sub(rec, 1, nl - 1)
    if is_level_of(KEYS[i], ARGV[5] .. qname) then
      local id = indexTtl > 0 and jix_task_id(string.sub(rec, nl + 1))
      local same = id and jix_owns(KEYS[10], id, tag)
      redis.call('HDEL', KEYS[1], tag)
      redis.call('HINCRBY', KEYS[7], qname, -1)
      fair_release(KEYS[7], qname, rec)
      local n = redis.call('HINCRBY', KEYS[6], tag, 1)
      if n > tonumber(ARGV[6]) then
        redis.call('HDEL', KEYS[6], tag)
        local meta = cjson.encode({
          reason = 'worker_lost',
          error = ARGV[8] .. ' ' .. n .. ' times',
          pool = ARGV[1],
          recoveries = n,
        })
        local did = dead_add(KEYS[8], KEYS[9], tag, meta .. '\n' .. rec)
        dead_trim(KEYS[8], KEYS[9], KEYS[10], indexTtl, tonumber(ARGV[7]), nil)
        if same then jix_set(KEYS[10], id, 'dead', qname, did, 'worker_lost') end
        cursor_drop(cursorPrefix, string.sub(rec, nl + 1), nil)
        dead[#dead + 1] = tag
        deadTags[tag] = true
      else
        push_front(ARGV[5] .. qname, KEYS[i], string.sub(rec, nl + 1))
        if redis.call('SADD', KEYS[5], qname) == 1 then
          redis.call('PUBLISH', ARGV[4], qname)
        end
        if same then
          jix_set(KEYS[10], id, 'queued', qname, jix_level(KEYS[i]),
                  tag_of(string.sub(rec, nl + 1)))
        end
        requeued[#requeued + 1] = tag
      end
    end
  end
end
if #dead > 0 and #KEYS > 11 + nTags then
  unique_release_tags({unpack(KEYS, 12 + nTags)}, deadTags)
end
if ARGV[2] == 'pool' and redis.call('HLEN', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[4], ARGV[1])
end
return {1, requeued, dead}
