-- busy: record (or clear) the job an execution slot of a pool is running.
-- KEYS[1]  busy hash of the pool        {ns}:busy:<pool id>
-- KEYS[2]  checkins hash                {ns}:checkins
-- KEYS[3]  stop requests zset           {ns}:stop_requests (the job's entry goes with it)
-- KEYS[4]  stats hash                   {ns}:stats
-- ARGV[1]  slot id (pid, or pid-thread)
-- ARGV[2]  "start", "end", or "lost": the process running the job died (reported by
--          the pool's main process, which does not know the slot): every record of
--          the job in this pool's busy hash is dropped, with its checkin, as at "end"
-- ARGV[3]  job id
-- ARGV[4]  job record JSON (start only), one line; started_at is added here
-- ARGV[5]  (end only) job queue name and ARGV[6] outcome ("processed"/"failed"/
--          "retried"): counted in the stats hash as "<outcome>:<queue>" and "<outcome>";
--          empty when the caller counts in memory and writes the stats hash itself
-- ARGV[7]  (start only) ms the job has already been running: started_at = now - this
-- Returns the Redis time in ms.
-- @include clock
local now = clock_ms()
local busyKey, jobId = KEYS[1], ARGV[3]
if ARGV[2] == 'start' then
  redis.call('HSET', busyKey, ARGV[1], (now - tonumber(ARGV[7] or 0)) .. '\n' .. ARGV[4])
elseif ARGV[2] == 'lost' then
  local slots = redis.call('HGETALL', busyKey)
  for i = 1, #slots, 2 do
    local rec = slots[i + 1]
    local nl = string.find(rec, '\n', 1, true)
    local ok, job = pcall(cjson.decode, string.sub(rec, (nl or 0) + 1))
    if ok and type(job) == 'table' and job['job_id'] == jobId then
      redis.call('HDEL', busyKey, slots[i])
    end
  end
  redis.call('HDEL', KEYS[2], jobId)
  redis.call('ZREM', KEYS[3], jobId)
else
  redis.call('HDEL', busyKey, ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[3])
  redis.call('ZREM', KEYS[3], ARGV[3])
  if ARGV[6] and ARGV[6] ~= '' then
    redis.call('HINCRBY', KEYS[4], ARGV[6] .. ':' .. ARGV[5], 1)
    redis.call('HINCRBY', KEYS[4], ARGV[6], 1)
  end
end
return now
