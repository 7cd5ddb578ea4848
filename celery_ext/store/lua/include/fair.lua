-- _fair: fair shares inside a job queue (fair.py, docs/fair.md), included by the
-- scripts that move jobs (a line "-- @include fair", see scripts.py).
-- A job queue with keyed jobs has, beside its priority level lists:
--   <queue key>\6\23       list  ring of its active fair keys (a non-empty sub-queue each)
--   <queue key>\6\23<key>  list  the sub-queue of one key, first in first out
-- Both are the queue key plus a suffix, so they carry its hash tag: a script given the
-- queue key (or one of its level keys) in KEYS addresses them in the same slot.
-- A key's jobs in flight, counted whether its queue has a per-key limit or not: field
-- "<queue name>\n<key>" of {ns}:running (removed at 0); the limit: field
-- "<queue name>\n" of {ns}:limits (keys.py).
-- A key's "not due until" state (its per-key rate limit, fair_rate_limit, and a hold a
-- job of the key asked for, raise Throttled: one state for both):
--   <queue key>\6\24<key>  string  Redis time (µs) from which the key's next job may be
--                                  fetched; it expires at that time, so a key that is
--                                  due (or idle) has none
local FAIR_SEP = '\6\23'
local FAIR_DUE_SEP = '\6\24'
local FAIR_FIELD = '"fair_key": "'

-- The fair key a stored payload (or "<queue>\n<payload>" record) carries, or nil: the
-- producer writes it as the last message property (fair.py), so only the last 1024
-- bytes are searched, the last occurrence winning.
local function fair_of(payload)
  local key, from = nil, math.max(1, #payload - 1023)
  while true do
    local _, e = string.find(payload, FAIR_FIELD, from, true)
    if not e then return key end
    key = string.match(payload, '^[^"\\]+', e + 1)
    from = e + 1
  end
end

-- Push a keyed job to its key's sub-queue of the job queue `queueKey` (the default
-- level's key): to the back (LPUSH, an enqueue) or the front (RPUSH, a job coming
-- back); a key whose sub-queue was empty joins the ring, at its tail (served after
-- the keys waiting now) or, coming back, at its head. Returns the sub-queue's length.
local function fair_push(queueKey, key, payload, front)
  local ring = queueKey .. FAIR_SEP
  local n = redis.call(front and 'RPUSH' or 'LPUSH', ring .. key, payload)
  if n == 1 then
    redis.call(front and 'LPUSH' or 'RPUSH', ring, key)
  end
  return n
end

-- Push a job to the front of its job queue: to `levelKey` (its priority level's list),
-- or, when it carries a fair key, to that key's sub-queue of `queueKey`.
local function push_front(queueKey, levelKey, payload)
  local key = fair_of(payload)
  if key then
    fair_push(queueKey, key, payload, true)
  else
    redis.call('RPUSH', levelKey, payload)
  end
end

-- A job left the in-flight record (`rec` = "<queue>\n<payload>"): its fair key's count
-- in the running hash goes down (removed at 0). Fetch counts every keyed job it records
-- in flight, whether its queue has a per-key limit or not: a limit written while jobs
-- of a key run finds them counted, so it admits no job beyond it (were only the jobs
-- fetched under a limit counted, those fetched before it would run uncounted beside
-- the limit's share, and their acks would take the others' counts down). A key without
-- a count (a job fetched by a release that counted only under a limit) is left alone.
-- Returns the count left, or nil (an unkeyed or uncounted job).
local function fair_release(running, qname, rec)
  local key = fair_of(rec)
  if not key then return nil end
  local field = qname .. '\n' .. key
  local n = tonumber(redis.call('HGET', running, field))
  if not n then return nil end
  if n <= 1 then
    redis.call('HDEL', running, field)
  else
    redis.call('HINCRBY', running, field, -1)
  end
  return n - 1
end

-- Push a new job to the back of its job queue `queueKey`'s list (the caller gives the
-- list of the job's priority level, or the queue key for a keyed job), or, when it
-- carries a fair key, of that key's sub-queue. Returns the list's length after it, and
-- whether a fair key joined the ring with it.
local function push_back(queueKey, payload)
  local key = fair_of(payload)
  if key then
    local n = fair_push(queueKey, key, payload, false)
    return n, n == 1
  end
  return redis.call('LPUSH', queueKey, payload), false
end

-- The Redis time (µs) from which the next job of fair key `key` of the job queue
-- `queueKey` may be fetched: 0 when its state expired or was never set.
local function fair_due(queueKey, key)
  return tonumber(redis.call('GET', queueKey .. FAIR_DUE_SEP .. key)) or 0
end

-- Hold fair key `key` of the job queue `queueKey` until `due_us` (Redis time, µs; `now_us`
-- is now): its state keeps the later of that and the hold it has (`held`, when the
-- caller read it with fair_due; nil: read here), and expires then.
local function fair_hold(queueKey, key, due_us, now_us, held)
  local state = queueKey .. FAIR_DUE_SEP .. key
  held = held or tonumber(redis.call('GET', state)) or 0
  if held > due_us then due_us = held end
  local ms = math.ceil((due_us - now_us) / 1000)
  if ms > 0 then
    redis.call('SET', state, string.format('%.0f', due_us), 'PX', ms)
  end
end
