#!lua flags=allow-oom
-- heartbeat: stamp a pool as alive with Redis server time.
-- KEYS[1]  pools zset                   {ns}:pools
-- KEYS[2]  pool hash                    {ns}:pool:<pool id>
-- ARGV[1]  pool id
-- ARGV[2]  "register" (always stamp) or "beat" (stamp only if still registered)
-- ARGV[3..] field, value pairs for the pool hash: a registration's, or (with "beat")
--          fields a registered pool changes, e.g. the job queues it consumes
-- Returns {registered, now_ms}: registered = 0 means the pool had been declared
-- dead (reaped) and did not stamp; the caller re-registers.
-- @include clock
local now = clock_ms()
if ARGV[2] ~= 'register' and not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return {0, now}
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
if ARGV[2] == 'register' then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 'registered_at', now)
end
if #ARGV > 2 then
  redis.call('HSET', KEYS[2], unpack(ARGV, 3))
end
redis.call('HSET', KEYS[2], 'heartbeat_at', now)
return {1, now}
