-- chord_part: count one header job's result toward its chord, once per task id.
-- KEYS[1]  chord        {ns:<group id>}:chord          hash: size, counted, claimed_by, state
-- KEYS[2]  counted ids  {ns:<group id>}:chord_ids      set of "<task id>:<header index>"
-- KEYS[3]  results      {ns:<group id>}:chord_results  zset: header result -> header index
-- ARGV[1]  the header job's task id
-- ARGV[2]  its place in the header (the zset's score; "+inf" when Celery gives none)
-- ARGV[3]  its result, encoded as Celery's chord results are ([1, id, state, result])
-- ARGV[4]  seconds the chord's keys live without news (chord expiry)
-- ARGV[5]  the chord's size from the job's request, used when chord_size.lua never ran
--          ("" when unknown)
-- A header job run twice (its pool died after it stored its result, before the ack)
-- counts once: the set of counted ids decides. Once every header job counted, exactly one
-- caller is told to publish the body: the first to find the count complete, or a second
-- run of that same job (its first run died before the body went out, chord_done.lua was
-- never called). A chord whose body was sent or that failed counts nothing more.
-- Returns {counted, size (-1: unknown), 1 if this caller publishes the body else 0}.
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'sent' or state == 'failed' then
  return {-1, -1, 0}
end
local member = ARGV[1] .. ':' .. ARGV[2]
if redis.call('SADD', KEYS[2], member) == 1 then
  redis.call('ZADD', KEYS[3], ARGV[2], ARGV[3])
  redis.call('HINCRBY', KEYS[1], 'counted', 1)
end
if not state then
  redis.call('HSET', KEYS[1], 'state', 'pending')
end
local size = tonumber(redis.call('HGET', KEYS[1], 'size') or ARGV[5]) or -1
if size >= 0 then
  redis.call('HSET', KEYS[1], 'size', size)
end
for i = 1, 3 do
  redis.call('EXPIRE', KEYS[i], ARGV[4])
end
local counted = tonumber(redis.call('HGET', KEYS[1], 'counted'))
local claimed = 0
if size >= 0 and counted >= size then
  local owner = redis.call('HGET', KEYS[1], 'claimed_by')
  if not owner or owner == ARGV[1] then
    redis.call('HSET', KEYS[1], 'claimed_by', ARGV[1])
    claimed = 1
  end
end
return {counted, size, claimed}
