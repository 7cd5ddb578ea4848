#!lua flags=allow-oom
-- unique_release: a unique job started (or expired); let identical jobs be enqueued
-- again, or, for a job locked until finished, renew its lock for the run.
-- KEYS[1]  lock                         {ns}:unique:<digest>
-- ARGV[1]  the job's task id
-- ARGV[2]  (optional) TTL in ms to renew the lock with instead of deleting it; "0" = delete
-- Acts only if this job holds the lock (a retry or a newer job may own it by now).
-- Returns 1 if released or renewed, 0 otherwise.
-- @include unique
local value = redis.call('GET', KEYS[1])
if not value or unique_holder(value) ~= ARGV[1] then
  return 0
end
local renewMs = tonumber(ARGV[2] or '0') or 0
if renewMs > 0 then
  return redis.call('PEXPIRE', KEYS[1], renewMs)
end
return redis.call('DEL', KEYS[1])
