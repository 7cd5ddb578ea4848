-- chord_size: a chord is publishing its header; record how many results its body waits for.
-- KEYS[1]  chord        {ns:<group id>}:chord          hash: size, counted, claimed_by, state,
--                                                       body, applied_at, error
-- KEYS[2]  counted ids  {ns:<group id>}:chord_ids      set of "<task id>:<header index>"
-- KEYS[3]  results      {ns:<group id>}:chord_results  zset: header result -> header index
-- ARGV[1]  header jobs the body waits for
-- ARGV[2]  seconds the chord's keys live without news (chord expiry)
-- Celery sets the size just before it publishes the header's last job, so the first jobs
-- may have been counted already: their counts stay. A chord that already settled (sent or
-- failed) and is applied again (a frozen chord reuses its group id) starts over, keeping
-- the body its apply_chord just recorded. Returns the Redis time it was applied at (ms),
-- the score of the chord in the pending chords' index.
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'sent' or state == 'failed' then
  local body = redis.call('HGET', KEYS[1], 'body')
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
  if body then
    redis.call('HSET', KEYS[1], 'body', body)
  end
end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('HSET', KEYS[1], 'size', ARGV[1], 'state', 'pending', 'applied_at', now)
redis.call('HSETNX', KEYS[1], 'counted', 0)
for i = 1, 3 do
  redis.call('EXPIRE', KEYS[i], ARGV[2])
end
return now
