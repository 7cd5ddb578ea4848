-- dead: move one job from a pool's in-flight record into the dead set, with why.
-- KEYS[1]  in-flight hash of the pool   {ns}:inflight:<pool id>
-- KEYS[2]  dead zset                    {ns}:dead
-- KEYS[3]  dead jobs hash               {ns}:dead_jobs
-- KEYS[4]  redelivery hash              {ns}:redelivery
-- KEYS[5]  running counts hash          {ns}:running
-- ARGV[1]  delivery tag (becomes the dead job id)
-- ARGV[2]  meta JSON (reason, error, pool, ...), one line
-- ARGV[3]  max dead jobs kept
-- ARGV[4]  max age of dead jobs, ms
-- Returns 1 if moved, 0 if the tag was not in flight (already moved: idempotent).
local rec = redis.call('HGET', KEYS[1], ARGV[1])
if not rec then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HINCRBY', KEYS[5], string.sub(rec, 1, string.find(rec, '\n', 1, true) - 1), -1)
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2] .. '\n' .. rec)
redis.call('ZADD', KEYS[2], now, ARGV[1])
-- Trim: too old first, then too many; bounded work per call.
local old = redis.call('ZRANGE', KEYS[2], '-inf', now - tonumber(ARGV[4]), 'BYSCORE', 'LIMIT', 0, 100)
for _, id in ipairs(old) do
  redis.call('HDEL', KEYS[3], id)
  redis.call('ZREM', KEYS[2], id)
end
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if over > 0 then
  local ids = redis.call('ZRANGE', KEYS[2], 0, math.min(over, 100) - 1)
  for _, id in ipairs(ids) do
    redis.call('HDEL', KEYS[3], id)
    redis.call('ZREM', KEYS[2], id)
  end
end
return 1
