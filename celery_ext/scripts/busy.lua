-- busy: record (or clear) the job an execution slot of a pool is running.
-- KEYS[1]  busy hash of the pool        {ns}:busy:<pool id>
-- KEYS[2]  checkins hash                {ns}:checkins
-- KEYS[3]  stop requests set            {ns}:stop
-- KEYS[4]  stats hash                   {ns}:stats
-- ARGV[1]  slot id (pid, or pid-thread)
-- ARGV[2]  "start" or "end"
-- ARGV[3]  job id
-- ARGV[4]  job record JSON (start only), one line; started_at is added here
-- ARGV[5]  (end only) job queue name and ARGV[6] outcome ("processed"/"failed"/
--          "retried"): counted in the stats hash as "<outcome>:<queue>" and "<outcome>";
--          empty when the caller counts in memory and writes the stats hash itself
-- ARGV[7]  (start only) ms the job has already been running: started_at = now - this
-- Returns the Redis time in ms.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[2] == 'start' then
  redis.call('HSET', KEYS[1], ARGV[1], (now - tonumber(ARGV[7] or 0)) .. '\n' .. ARGV[4])
else
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[3])
  redis.call('SREM', KEYS[3], ARGV[3])
  if ARGV[6] and ARGV[6] ~= '' then
    redis.call('HINCRBY', KEYS[4], ARGV[6] .. ':' .. ARGV[5], 1)
    redis.call('HINCRBY', KEYS[4], ARGV[6], 1)
  end
end
return now
