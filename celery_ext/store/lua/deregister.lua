#!lua flags=allow-oom
-- deregister: a pool leaves cleanly (warm shutdown), after returning its jobs.
-- KEYS[1]  pools zset                   {ns}:pools
-- KEYS[2]  pool hash                    {ns}:pool:<pool id>
-- KEYS[3]  in-flight hash of the pool   {ns}:inflight:<pool id>
-- KEYS[4]  in-flight pools set          {ns}:inflight_pools
-- ARGV[1]  pool id
-- A pool that still owns jobs stays in the in-flight pools set, so the reaper
-- finds them as orphans and requeues them. Returns the number of jobs left.
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
local left = redis.call('HLEN', KEYS[3])
if left == 0 then
  redis.call('SREM', KEYS[4], ARGV[1])
end
return left
