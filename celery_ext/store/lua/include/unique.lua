-- _unique: a unique job's lock {ns}:unique:<digest> (a line "-- @include unique", see
-- scripts.py). Its value is the task id of the job holding it; for a job locked until
-- finished, the task id, a newline and the delivery tag of the message holding it now
-- (a retry is a new message under the same task id: options/unique.py).
-- The task id part of a lock's value.
local function unique_holder(value)
  local nl = string.find(value, '\n', 1, true)
  return nl and string.sub(value, 1, nl - 1) or value
end
-- The delivery tag part of a lock's value ('' for a job locked until started).
local function unique_tag(value)
  local nl = string.find(value, '\n', 1, true)
  return nl and string.sub(value, nl + 1) or ''
end
-- Delete each lock of `locks` (key names) whose holder is one of `tags` (a set of
-- delivery tags of messages that just made their final move). Returns how many.
local function unique_release_tags(locks, tags)
  local n = 0
  for _, lock in ipairs(locks) do
    local value = redis.call('GET', lock)
    if value and tags[unique_tag(value)] then
      redis.call('DEL', lock)
      n = n + 1
    end
  end
  return n
end
-- Delete the unique lock a job's message names (its "celery_ext_unique" header, either
-- mode), under `prefix` ({ns}:unique: of the job's copy; "" = none given), if the job's
-- task id `id` holds it: a revoked job never reaches the ack or the start that would
-- release it. A revoke covers every message of its task id, so the task id part of
-- the value decides. Returns 1 if deleted, else 0.
local UNIQUE_FIELD = '"celery_ext_unique": "'
local function unique_release_job(prefix, payload, id)
  if not prefix or prefix == '' or not id then return 0 end
  local _, e = string.find(payload, UNIQUE_FIELD, 1, true)
  local digest = e and string.match(payload, '^[^"\\]+', e + 1)
  if not digest then return 0 end
  local lock = prefix .. digest
  local value = redis.call('GET', lock)
  if value and unique_holder(value) == id then
    return redis.call('DEL', lock)
  end
  return 0
end
