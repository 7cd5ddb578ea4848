-- stats: add a process's summed job counters to the stats hash, one command.
-- KEYS[1]  stats hash                   {ns}:stats (or the runtime hash {ns}:runtime)
-- KEYS[2]  known queues set             {ns}:queues (optional)
-- ARGV[1], ARGV[2], ...  field, amount, field, amount, ... ("processed", "failed:<queue>"...)
-- One HINCRBY each, as a pipeline would send them: with 1,000 job names a flush
-- holds about one field per job run, and 1,000 pipelined commands cost a prefork
-- child three times the CPU of one call carrying them (measured).
-- With KEYS[2], the queue of each per-queue field ("<prefix>:<queue>") is added to the
-- known queues: a flush that comes after a reader forgot the queue (queue_info.lua
-- deletes its fields then) makes the next reader forget the fields again, so none is
-- left behind.
-- Returns the number of fields updated.
for i = 1, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
  if KEYS[2] then
    local queue = string.match(ARGV[i], '^[^:]*:(.+)$')
    if queue then redis.call('SADD', KEYS[2], queue) end
  end
end
return #ARGV / 2
