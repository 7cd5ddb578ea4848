-- _announce: a job was pushed onto a job queue (a line "-- @include announce" in the
-- scripts that create jobs: enqueue, enqueue_unique, periodic_run).
-- SADD on every push keeps the ready set self-healing; only a queue that just became
-- non-empty is announced: added to the known queues (not Kombu's "*.pidbox" reply
-- queues) and published on the wake channel, so busy systems publish almost nothing.
local function announce(readyKey, queuesKey, wakeChannel, queueName)
  if redis.call('SADD', readyKey, queueName) == 1 then
    if string.sub(queueName, -7) ~= '.pidbox' then
      redis.call('SADD', queuesKey, queueName)
    end
    redis.call('PUBLISH', wakeChannel, queueName)
  end
end
