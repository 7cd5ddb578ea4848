-- cursor: a resumable job's cursor (worker/cursor.py), kept by task id in its job
-- queue's copy so that it travels with the job through recovery and returns.
-- KEYS[1]  the job's cursor             {ns}:cursor:<task id>
-- ARGV[1]  "save": write ARGV[3], owned by the run ARGV[2] ("" = by no run: the job
--          retries, and its next run takes it), for ARGV[4] ms;
--          "read": the cursor; the run ARGV[2] now owns it (its ack removes it);
--          "drop": remove it if the run ARGV[2] owns it (a job acked when it started
--          that finished: no ack of it is to come)
-- ARGV[2]  delivery tag of the run
-- ARGV[3]  cursor JSON (save)
-- ARGV[4]  TTL, ms (save, read)
-- The value is "<owner delivery tag>\n<cursor JSON>". Returns the cursor JSON (read:
-- false when there is none), 1 (save), or whether it was removed (drop).
local key, mode, tag = KEYS[1], ARGV[1], ARGV[2]
if mode == 'save' then
  redis.call('SET', key, tag .. '\n' .. ARGV[3], 'PX', ARGV[4])
  return 1
end
local value = redis.call('GET', key)
if not value then return false end
local nl = string.find(value, '\n', 1, true)
local owner, cursor = string.sub(value, 1, nl - 1), string.sub(value, nl + 1)
if mode == 'read' then
  if owner ~= tag then
    redis.call('SET', key, tag .. '\n' .. cursor, 'PX', ARGV[4])
  end
  return cursor
end
if owner == tag then
  redis.call('DEL', key)
  return 1
end
return 0
