-- periodic_sync: record the leader's periodic job entries and give each one that has
-- no next due time (new, or its schedule changed) the one the leader computed.
-- KEYS[1]  entry index set           {ns}:periodic
-- KEYS[2]  runtime entries hash      {ns}:periodic_runtime
-- KEYS[3 .. n+2]  entry state hashes {ns}:periodic:<name>, one per entry (n = ARGV[1])
-- KEYS[n+3 ..]    state hashes of entries in the index the leader no longer has
-- ARGV[1]  n, the number of entries
-- ARGV[2 ..] six values per entry, in the order of KEYS[3 .. n+2]: name; spec (task,
--          schedule and the app's time zone: a new spec means new due times); its first
--          due time after now (ms); task name; schedule as shown to people; the runtime
--          record the leader read ("" = an entry of the app's beat_schedule)
-- ARGV[2 + 6n ..] names of the stale entries, in the order of KEYS[n+3 ..]
-- ARGV[last] how long (ms) a stale entry's state is kept (a re-added entry keeps its
--          pause flag and history)
-- A state whose next_due is set under the same spec keeps it: a leader that takes over
-- continues where the last one stopped. An entry whose runtime record is no longer the
-- one the leader read (set, changed or removed meanwhile) is left alone, and so is a
-- stale entry that has a runtime record: the leader's next pass reads it again, so a
-- leader that read before a change never writes its old schedule over the new one.
-- Returns the number of entries given a new next due time.
local indexKey, runtimeKey = KEYS[1], KEYS[2]
local n = tonumber(ARGV[1])
local staleTtl = ARGV[#ARGV]
local fresh = 0
for i = 1, n do
  local stateKey = KEYS[2 + i]
  local base = 2 + (i - 1) * 6
  local name, spec, firstDue, task, shown, record = ARGV[base], ARGV[base + 1],
    ARGV[base + 2], ARGV[base + 3], ARGV[base + 4], ARGV[base + 5]
  if (redis.call('HGET', runtimeKey, name) or '') == record then
    redis.call('SADD', indexKey, name)
    redis.call('PERSIST', stateKey)
    local current = redis.call('HMGET', stateKey, 'next_due', 'spec')
    if not current[1] or current[2] ~= spec then
      redis.call('HSET', stateKey, 'next_due', firstDue, 'spec', spec)
      fresh = fresh + 1
    end
    local source = 'config'
    if record ~= '' then source = 'runtime' end
    redis.call('HSET', stateKey, 'task', task, 'schedule', shown, 'source', source)
  end
end
for j = n + 3, #KEYS do
  local name = ARGV[2 + 6 * n + (j - n - 3)]
  if redis.call('HEXISTS', runtimeKey, name) == 0 then
    redis.call('SREM', indexKey, name)
    redis.call('PEXPIRE', KEYS[j], staleTtl)
  end
end
return fresh
