-- schedule: store a job with a future due time in the scheduled (or retry) set,
-- optionally as a unique job, and wake requeuers if it is now the earliest.
-- KEYS[1]  target zset                  {ns}:scheduled or {ns}:retry
-- KEYS[2]  scheduled jobs hash          {ns}:scheduled_jobs
-- KEYS[3]  the other zset               {ns}:retry or {ns}:scheduled
-- KEYS[4]  known queues set             {ns}:queues
-- KEYS[5]  (unique jobs only) lock      {ns}:unique:<digest>
-- ARGV[1]  job id (delivery tag)
-- ARGV[2]  delay in ms from now (Redis time)
-- ARGV[3]  meta JSON object (one line); "scheduled_at" is added here
-- ARGV[4]  queue name
-- ARGV[5]  message payload (kombu JSON)
-- ARGV[6]  schedule channel             {ns}:schedule
-- ARGV[7]  (unique) lock value: the job's task id
-- ARGV[8]  (unique) lock TTL in ms, counted from the due time
-- ARGV[9]  (unique) "1" = schedule even if the lock is held (a retry), else "0"
-- Returns {1, due ms, task id} when scheduled, {0, 0, holder} when a unique job
-- with the same key is already pending (nothing stored; the same task id
-- published twice counts as pending).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = now + tonumber(ARGV[2])
if #KEYS >= 5 then
  local holder = redis.call('GET', KEYS[5])
  if holder and ARGV[9] ~= '1' then
    return {0, 0, holder}
  end
  if not holder or holder == ARGV[7] then
    redis.call('SET', KEYS[5], ARGV[7], 'PX', tonumber(ARGV[2]) + tonumber(ARGV[8]))
  end
end
local meta = cjson.decode(ARGV[3])
meta['scheduled_at'] = now
-- The earliest due time before this job, over both sets.
local earliest = nil
for _, k in ipairs({KEYS[1], KEYS[3]}) do
  local head = redis.call('ZRANGE', k, 0, 0, 'WITHSCORES')
  if head[2] and (not earliest or tonumber(head[2]) < earliest) then
    earliest = tonumber(head[2])
  end
end
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(meta) .. '\n' .. ARGV[4] .. '\n' .. ARGV[5])
redis.call('ZADD', KEYS[1], due, ARGV[1])
redis.call('SADD', KEYS[4], ARGV[4])
if not earliest or due < earliest then
  redis.call('PUBLISH', ARGV[6], due)
end
return {1, due, ARGV[7] or ''}
