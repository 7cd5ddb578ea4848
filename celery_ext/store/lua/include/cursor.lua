-- A resumable job's cursor ends with the job (worker/cursor.py): drop the cursor of the
-- job whose payload is given, under `prefix` ({ns}:cursor:, "" = none given). With a
-- delivery tag, only if that run owns it: the ack of a run that retried leaves its
-- cursor to the retry. Uses jix_task_id (include/job_index.lua).
local function cursor_drop(prefix, payload, tag)
  if not prefix or prefix == '' then return end
  local id = jix_task_id(payload)
  if not id then return end
  local key = prefix .. id
  if tag then
    local value = redis.call('GET', key)
    if not value or string.sub(value, 1, #tag + 1) ~= tag .. '\n' then return end
  end
  redis.call('DEL', key)
end
