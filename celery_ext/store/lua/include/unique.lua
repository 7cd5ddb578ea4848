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
