-- periodic_sync: record the leader's periodic job entries and give each one that has
-- no next due time (new, or its schedule changed) the one the leader computed.
-- KEYS[1]  entry index set           {ns}:periodic
-- KEYS[2 .. n+1]  entry state hashes {ns}:periodic:<name>, one per entry (n = ARGV[1])
-- KEYS[n+2 ..]    state hashes of entries in the index the schedule no longer has
-- ARGV[1]  n, the number of entries
-- ARGV[2 ..] five values per entry, in the order of KEYS[2 .. n+1]: name; spec (task,
--          schedule and the app's time zone: a new spec means new due times); its first
--          due time after now (ms); task name; schedule as shown to people
-- ARGV[2 + 5n ..] names of the stale entries, in the order of KEYS[n+2 ..]
-- ARGV[last] how long (ms) a stale entry's state is kept (a re-added entry keeps its
--          pause flag and history)
-- A state whose next_due is set under the same spec keeps it: a leader that takes over
-- continues where the last one stopped. Returns the number of entries given a new
-- next due time.
local indexKey = KEYS[1]
local n = tonumber(ARGV[1])
local staleTtl = ARGV[#ARGV]
local fresh = 0
for i = 1, n do
  local stateKey = KEYS[1 + i]
  local base = 2 + (i - 1) * 5
  local name, spec, firstDue, task, shown = ARGV[base], ARGV[base + 1], ARGV[base + 2],
    ARGV[base + 3], ARGV[base + 4]
  redis.call('SADD', indexKey, name)
  redis.call('PERSIST', stateKey)
  local current = redis.call('HMGET', stateKey, 'next_due', 'spec')
  if not current[1] or current[2] ~= spec then
    redis.call('HSET', stateKey, 'next_due', firstDue, 'spec', spec)
    fresh = fresh + 1
  end
  redis.call('HSET', stateKey, 'task', task, 'schedule', shown)
end
for j = n + 2, #KEYS do
  redis.call('SREM', indexKey, ARGV[2 + 5 * n + (j - n - 2)])
  redis.call('PEXPIRE', KEYS[j], staleTtl)
end
return fresh
