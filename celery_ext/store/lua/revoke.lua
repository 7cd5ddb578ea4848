-- revoke: record revoked task ids in one copy of the layout, and move the ones the job
-- index finds in this copy's scheduled or retry set to the dead set at once (reason
-- "revoked"). A revoked id found queued is dropped by the fetch that pops it
-- (fetch.lua: one ZSCORE per job, where a LREM here would scan the list); one in flight
-- is reported, for a stop request when the revoke terminates.
-- KEYS[1]  revoked ids zset             {ns}:revoked (include/revoked.lua)
-- KEYS[2]  revokes' meta hash           {ns}:revoked_by
-- KEYS[3]  job index hash               {ns}:jobs
-- KEYS[4]  finished index entries       {ns}:jobs_done
-- KEYS[5]  dead zset                    {ns}:dead
-- KEYS[6]  dead jobs hash               {ns}:dead_jobs
-- KEYS[7]  scheduled zset               {ns}:scheduled
-- KEYS[8]  retry zset                   {ns}:retry
-- KEYS[9]  scheduled jobs hash          {ns}:scheduled_jobs
-- ARGV[1]  the revoke's meta, a one-line JSON object ({"reason":"revoked","by":...});
--          "revoked_at" (Redis ms) is added here
-- ARGV[2]  how long the revoke holds, ms (revoked_ttl)
-- ARGV[3]  most revoked ids kept (revoked_max): the oldest are dropped first
-- ARGV[4]  max dead jobs kept
-- ARGV[5]  max age of dead jobs, ms
-- ARGV[6]  job index TTL of finished entries in ms, "0" = no index (nothing is found
--          by id then: a scheduled job is dropped at the fetch after its promotion)
-- ARGV[7..] task ids
-- Both revoked keys expire ARGV[2] ms after this revoke, when every id in them has lapsed.
-- Returns {moved, inflight, queued}: moved = {task id, "scheduled" or "retry", ...} of
-- the jobs moved to the dead set; inflight, queued = task ids the index says are in
-- flight or queued in this copy.
-- @include clock
-- @include job_index
-- @include dead_set
local now = clock_ms()
local indexTtl = tonumber(ARGV[6]) or 0
local meta = string.sub(ARGV[1], 1, -2) .. ',"revoked_at":' .. now .. '}'
local lapses = now + tonumber(ARGV[2])
local sets = {scheduled = KEYS[7], retry = KEYS[8]}
local moved, inflight, queued = {}, {}, {}
for i = 7, #ARGV do
  local id = ARGV[i]
  redis.call('ZADD', KEYS[1], lapses, id)
  redis.call('HSET', KEYS[2], id, meta)
  local f = indexTtl > 0 and jix_get(KEYS[3], id)
  if f and sets[f[1]] then
    local ref = f[4]
    local rec = redis.call('HGET', KEYS[9], ref)
    if rec and redis.call('ZREM', sets[f[1]], ref) == 1 then
      redis.call('HDEL', KEYS[9], ref)
      local nl = string.find(rec, '\n', 1, true)
      local did = dead_add(KEYS[5], KEYS[6], ref, meta .. '\n' .. string.sub(rec, nl + 1))
      jix_set(KEYS[3], id, 'dead', f[3], did, 'revoked')
      moved[#moved + 1] = id
      moved[#moved + 1] = f[1]
    end
  elseif f and f[1] == 'inflight' then
    inflight[#inflight + 1] = id
  elseif f and f[1] == 'queued' then
    queued[#queued + 1] = id
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
