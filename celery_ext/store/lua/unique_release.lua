#!lua flags=allow-oom
-- unique_release: a unique job started; let identical jobs be enqueued again.
-- KEYS[1]  lock                         {ns}:unique:<digest>
-- ARGV[1]  the job's task id
-- Deletes the lock only if this job holds it (a retry or a newer job may own it
-- by now). Returns 1 if released, 0 otherwise.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
