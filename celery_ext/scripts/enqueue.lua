-- enqueue: append one job to the back of its job queue and wake idle pools.
-- KEYS[1]  job queue list            {ns}:queue:<name>
-- KEYS[2]  ready set                 {ns}:ready
-- KEYS[3]  known queues set          {ns}:queues (job queues only)
-- ARGV[1]  message payload (kombu JSON)
-- ARGV[2]  queue name
-- ARGV[3]  wake channel              {ns}:wake
-- ARGV[4]  queue expiry in ms (x-expires), 0 = never
-- Kombu's remote-control replies (queues named "<id>.reply.<mailbox>.pidbox", one per
-- `celery inspect`/`control` call) use the same path but are not job queues: they are
-- not recorded in the known queues set (queue_info.lua drops such names too).
-- Returns the queue length after the push.
local n = redis.call('LPUSH', KEYS[1], ARGV[1])
-- SADD on every push keeps the ready set self-healing; only a queue that just
-- became non-empty is announced, so busy systems publish almost nothing.
if redis.call('SADD', KEYS[2], ARGV[2]) == 1 then
  if string.sub(ARGV[2], -7) ~= '.pidbox' then
    redis.call('SADD', KEYS[3], ARGV[2])
  end
  redis.call('PUBLISH', ARGV[3], ARGV[2])
end
if tonumber(ARGV[4]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return n
