-- stats: add a process's summed job counters to the stats hash, one command.
-- KEYS[1]  stats hash                   {ns}:stats
-- ARGV[1], ARGV[2], ...  field, amount, field, amount, ... ("processed", "failed:<queue>"...)
-- One HINCRBY each, as a pipeline would send them: with 1,000 job names a flush
-- holds about one field per job run, and 1,000 pipelined commands cost a prefork
-- child three times the CPU of one call carrying them (measured).
-- Returns the number of fields updated.
for i = 1, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
return #ARGV / 2
