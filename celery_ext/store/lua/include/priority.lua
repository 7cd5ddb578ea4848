-- _priority: priority level lists of a job queue (priority.py, docs/priority.md),
-- included by the scripts that put a job back (a line "-- @include priority").
-- Whether `key` is one of the priority level lists of the job queue whose default
-- level list is `queueKey`: that key itself, or it followed by "\6\22<level>" (keys.py).
local function is_level_of(key, queueKey)
  if key == queueKey then return true end
  return string.sub(key, 1, #queueKey + 2) == queueKey .. '\6\22'
    and string.find(key, '^%d+$', #queueKey + 3) ~= nil
end
