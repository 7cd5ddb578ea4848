-- revoked fragment: pasted where a script says "-- @include revoked" (after "-- @include
-- clock" and "-- @include job_index", whose helpers these call). Revoked task ids
-- (store/revoked.py):
-- {ns}:revoked      zset  task id -> ms when its revoke lapses
-- {ns}:revoked_by   hash  task id -> meta JSON of the revoke ({"reason":"revoked", ...})
-- The meta JSON of the revoke of task `id` while it holds, or nil (not revoked, lapsed,
-- or no task id): one ZSCORE, and one HGET for a revoked id.
local function revoked_meta(revoked, by, id)
  if not id then return nil end
  local lapses = redis.call('ZSCORE', revoked, id)
  if not lapses or tonumber(lapses) <= clock_ms() then return nil end
  return redis.call('HGET', by, id) or '{"reason":"revoked"}'
end
