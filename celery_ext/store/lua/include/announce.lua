-- _announce: a new job is pushed onto a job queue (a line "-- @include announce" in the
-- scripts that create jobs: enqueue, enqueue_unique, periodic_run, each after
-- "-- @include fair", "-- @include job_index" and "-- @include delivery_tag", whose helpers
-- push_new calls).
-- SADD on every push keeps the ready set self-healing; only a queue that just became
-- non-empty is announced: added to the known queues (not Kombu's "*.pidbox" reply
-- queues) and published on the wake channel, so busy systems publish almost nothing.
-- A fair key joining the ring of a queue that has jobs (`joined`) is published too:
-- pools may sleep on that queue until its other keys are due (a per-key rate limit, a
-- job's Throttled hold), and the new key's job must not wait for them.
local function announce(readyKey, queuesKey, wakeChannel, queueName, joined)
  if redis.call('SADD', readyKey, queueName) == 1 then
    if string.sub(queueName, -7) ~= '.pidbox' then
      redis.call('SADD', queuesKey, queueName)
    end
    redis.call('PUBLISH', wakeChannel, queueName)
  elseif joined then
    redis.call('PUBLISH', wakeChannel, queueName)
  end
end

-- Push a new job to the back of its job queue (push_back: its level's list, or its fair
-- key's sub-queue), announce it, write its job index entry (indexTtl > 0; no entry for a
-- nil jobId; with the delivery tag the fetch will record it under, include/job_index.lua)
-- and renew the queue's expiry (expiresMs > 0). Returns push_back's length.
local function push_new(queueKey, payload, readyKey, queuesKey, wakeChannel, queueName,
                        indexKey, jobId, indexTtl, expiresMs)
  local n, joined = push_back(queueKey, payload)
  announce(readyKey, queuesKey, wakeChannel, queueName, joined)
  if indexTtl > 0 then
    jix_set(indexKey, jobId, 'queued', queueName, jix_level(queueKey),
            jobId and tag_of(payload))
  end
  if expiresMs > 0 then
    redis.call('PEXPIRE', queueKey, expiresMs)
  end
  return n
end
