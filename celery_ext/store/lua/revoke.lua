-- revoke: record revoked task ids in one copy of the layout, and move the jobs the job
-- index finds in this copy queued, scheduled or retrying to the dead set at once
-- (reason "revoked"), releasing their unique locks and dropping their cursors; a job in
-- flight is reported, for a stop request when the revoke terminates.
-- A queued job is found in the list of the priority level its index entry names: that
-- list is read from its oldest end (the fetch's) in chunks of SCAN_CHUNK until the job
-- is there, then LREM takes it out from that end. O(jobs ahead of it in that list), at
-- most ARGV[10] of them: the price of accounting for it at the revoke (docs/revoke.md,
-- "What it costs"). A job further back, a keyed job (a fair key's sub-queue, not named
-- by the index) or one not found (popped meanwhile) is left to the fetch that pops it
-- (fetch.lua drops a revoked id).
-- A queued entry whose delivery tag a pool of this copy holds in flight (the fetch leaves
-- the entry as it was: include/job_index.lua) is that job in flight, as an entry of the
-- earlier format saying inflight is: reported, not looked for in its queue.
-- KEYS[1]  revoked ids zset             {ns}:revoked (include/revoked.lua)
-- KEYS[2]  revokes' meta hash           {ns}:revoked_by
-- KEYS[3]  job index hash               {ns}:jobs
-- KEYS[4]  finished index entries       {ns}:jobs_done
-- KEYS[5]  dead zset                    {ns}:dead
-- KEYS[6]  dead jobs hash               {ns}:dead_jobs
-- KEYS[7]  scheduled zset               {ns}:scheduled
-- KEYS[8]  retry zset                   {ns}:retry
-- KEYS[9]  scheduled jobs hash          {ns}:scheduled_jobs
-- KEYS[10] redelivery hash              {ns}:redelivery (a requeued job's count goes with it)
-- KEYS[11] in-flight pools set          {ns}:inflight_pools
-- ARGV[1]  the revoke's meta, a one-line JSON object ({"reason":"revoked","by":...});
--          "revoked_at" (Redis ms) is added here
-- ARGV[2]  how long the revoke holds, ms (revoked_ttl)
-- ARGV[3]  most revoked ids kept (revoked_max): the oldest are dropped first
-- ARGV[4]  max dead jobs kept
-- ARGV[5]  max age of dead jobs, ms
-- ARGV[6]  job index TTL of finished entries in ms, "0" = no index (nothing is found
--          by id then: a queued or scheduled job is dropped at its fetch)
-- ARGV[7]  job queue key prefix         {ns}:queue: (a level list: keys.py)
-- ARGV[8]  unique lock key prefix       {ns}:unique: (include/unique.lua)
-- ARGV[9]  cursor key prefix            {ns}:cursor: (include/cursor.lua)
-- ARGV[10] most jobs of a level list read to find one queued job (REVOKE_SCAN_MAX)
-- ARGV[11] in-flight hash key prefix  {ns}:inflight: (a pool's hash: the prefix and its id)
-- ARGV[12..] task ids
-- Both revoked keys expire ARGV[2] ms after this revoke, when every id in them has lapsed.
-- Returns {moved, inflight, queued}: moved = {task id, "queued", "scheduled" or
-- "retry", ...} of the jobs moved to the dead set; inflight, queued = task ids the
-- index says are in flight, or queued but not found within ARGV[10] jobs of the
-- fetch's end of their level list, in this copy.
-- @include clock
-- @include job_index
-- @include dead_set
-- @include delivery_tag
-- @include unique
-- @include cursor
local SCAN_CHUNK = 1000
local now = clock_ms()
local indexTtl = tonumber(ARGV[6]) or 0
local meta = string.sub(ARGV[1], 1, -2) .. ',"revoked_at":' .. now .. '}'
local lapses = now + tonumber(ARGV[2])
local sets = {scheduled = KEYS[7], retry = KEYS[8]}
local moved, inflight, queued = {}, {}, {}
-- The payload of task `id`'s job in the list `list`, oldest first, or nil.
local function find_queued(list, id)
  local n = math.min(redis.call('LLEN', list), tonumber(ARGV[10]))
  for stop = -1, -n, -SCAN_CHUNK do
    local chunk = redis.call('LRANGE', list, math.max(stop - SCAN_CHUNK + 1, -n), stop)
    for j = #chunk, 1, -1 do
      -- (the plain find skips most payloads before the exact read of the id)
      if string.find(chunk[j], id, 1, true) and jix_task_id(chunk[j]) == id then
        return chunk[j]
      end
    end
  end
  return nil
end
-- To the dead set: the job of task `id` (its record "<queue>\n<payload>") under `ref`,
-- taken out of where it was; its lock and cursor go with it.
local function to_dead(id, ref, rec, queue)
  local payload = jix_payload_after(rec, 1)
  local did = dead_add(KEYS[5], KEYS[6], ref, meta .. '\n' .. rec)
  jix_set(KEYS[3], id, 'dead', queue, did, 'revoked')
  unique_release_job(ARGV[8], payload, id)
  cursor_drop(ARGV[9], payload, nil)
end
for i = 12, #ARGV do
  local id = ARGV[i]
  redis.call('ZADD', KEYS[1], lapses, id)
  redis.call('HSET', KEYS[2], id, meta)
  local f = indexTtl > 0 and jix_get(KEYS[3], id)
  if f and sets[f[1]] then
    local ref = f[4]
    local rec = redis.call('HGET', KEYS[9], ref)
    if rec and redis.call('ZREM', sets[f[1]], ref) == 1 then
      redis.call('HDEL', KEYS[9], ref)
      to_dead(id, ref, string.sub(rec, string.find(rec, '\n', 1, true) + 1), f[3])
      moved[#moved + 1] = id
      moved[#moved + 1] = f[1]
    end
  elseif f and (f[1] == 'inflight' or f[1] == 'queued'
                and jix_pool_of(KEYS[11], ARGV[11], f[5])) then
    inflight[#inflight + 1] = id
  elseif f and f[1] == 'queued' then
    local list = ARGV[7] .. f[3] .. ((f[4] == '0' or f[4] == '') and '' or '\6\22' .. f[4])
    local payload = find_queued(list, id)
    if payload and redis.call('LREM', list, -1, payload) == 1 then
      local tag = tag_of(payload)
      redis.call('HDEL', KEYS[10], tag)
      to_dead(id, tag, f[3] .. '\n' .. payload, f[3])
      moved[#moved + 1] = id
      moved[#moved + 1] = 'queued'
    else
      queued[#queued + 1] = id
    end
  end
end
-- Bounded: the lapsed revokes, then the oldest beyond the cap (100 of each per call).
local old = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, 100)
local over = redis.call('ZCARD', KEYS[1]) - #old - tonumber(ARGV[3])
if over > 0 then
  for _, id in ipairs(redis.call('ZRANGE', KEYS[1], #old, #old + math.min(over, 100) - 1)) do
    old[#old + 1] = id
  end
end
for _, id in ipairs(old) do
  redis.call('ZREM', KEYS[1], id)
  redis.call('HDEL', KEYS[2], id)
end
-- Every id here lapses by then: a copy no later revoke visits (its job queue forgotten
-- on a cluster) loses both keys whole.
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
dead_trim(KEYS[5], KEYS[6], KEYS[3], indexTtl, tonumber(ARGV[4]), tonumber(ARGV[5]))
return {moved, inflight, queued}
