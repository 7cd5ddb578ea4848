-- history: add job counts or a queue-size sample to the per-minute and per-hour
-- history (see celery_ext/store/history.py for the layout and the value format); in
-- "count" mode also a process's job counters, so its once-per-flush write is one call.
-- KEYS[1..3] minute hashes    {ns}:history:m:<minute> for minutes m-1, m, m+1
-- KEYS[4..6] hour hashes      {ns}:history:h:<hour> of those three minutes
-- KEYS[7]    stats hash       {ns}:stats      (count mode, when S > 0)
-- KEYS[8]    runtime hash     {ns}:runtime    (count mode, when R > 0)
-- KEYS[9]    known queues set {ns}:queues     (count mode, when Q > 0)
-- ARGV[1]  m: the caller's guess of the current minute (ms since epoch // 60000)
-- ARGV[2]  mode: "count" (job counts, summed) or "gauge" (a sample, replaced)
-- ARGV[3]  ms a minute hash lives past the end of its minute
-- ARGV[4]  ms an hour hash lives past the end of its hour
-- gauge:  ARGV[5] one packed sample stored under the field "q"
-- count:  ARGV[5] S, ARGV[6] R, ARGV[7] Q: how many stats pairs, runtime pairs and job
--         queues follow; then S pairs field, amount (added to KEYS[7] as HINCRBY adds),
--         R pairs field, amount (added to KEYS[8]): the fields of no queue; then Q triples
--         of one queue's fields: the queue's name, its KEYS[7] increments and its KEYS[8]
--         increments, each "<prefix> <amount> <prefix> <amount> ..." for the fields
--         "<prefix>:<queue>" (a prefix holds neither a space nor a colon, the name may
--         hold anything); a queue with KEYS[7] increments joins KEYS[9] (SADD: the
--         queues of the per-queue stats fields, so a reader that forgot one forgets them
--         again); then the history: pairs field ("n:<job name>", or "*" for all jobs),
--         packed increments "<processed> <failed> <retried> [<bucket>:<n> ...]". Each
--         field comes once per call (the caller sums in memory): fields are read and
--         written a thousand at a time, so a field given twice would keep one amount.
--         A queue's fields travel as three arguments, not two per field: at 10,000 job
--         names a flush carries seven fields per name that ran, and each argument costs
--         the caller's encoding and Redis's parsing (issue 36).
-- The minute comes from Redis TIME: the caller passes the keys of three candidate
-- minutes (the Redis Cluster rule: a script touches only the keys it is given) and
-- the script writes to the one that is now. Returns {1, now ms} when written,
-- {0, now ms} when none of the three is now (the caller's clock is off: it corrects
-- its guess with the returned time and calls again with S = R = Q = 0). The counters
-- (S, R, Q) are written either way: they have no minute.
-- @include clock
local guess, mode = tonumber(ARGV[1]), ARGV[2]
local minuteTtlMs, hourTtlMs = tonumber(ARGV[3]), tonumber(ARGV[4])
local first = 5
-- Fields per HMGET, HSET or SADD: unpack's stack is bounded.
local CHUNK = 1000
-- The largest count a double holds exactly (2^53): a field past it is added to by HINCRBY.
local EXACT = 9007199254740992

-- Writes the fields `fields` with the values `values` to the hash `key`, each new value
-- made by `combine(old value or false, value)`: one HMGET and one HSET per CHUNK fields,
-- not a command per field. A redis.call costs about a microsecond whatever it does, and
-- at 10,000 job names a flush carries a field per name that ran, seven per name in all
-- (issue 36). `combine` returns nil to leave the field to HINCRBY.
local function update(key, fields, values, combine)
  local n = #fields
  for c = 0, n - 1, CHUNK do
    local m = math.min(CHUNK, n - c)
    local old = redis.call('HMGET', key, unpack(fields, c + 1, c + m))
    local new, k = {}, 0
    for j = 1, m do
      local field, value = fields[c + j], values[c + j]
      local v = combine(old[j], value)
      if v then
        new[k + 1], new[k + 2], k = field, v, k + 2
      else
        redis.call('HINCRBY', key, field, value)
      end
    end
    if k > 0 then redis.call('HSET', key, unpack(new, 1, k)) end
  end
end

-- The `n` pairs field, value from ARGV[at] on, added to `fields` and `values`.
local function pairs_from(at, n, fields, values)
  for j = 0, n - 1 do
    fields[#fields + 1], values[#values + 1] = ARGV[at + 2 * j], ARGV[at + 2 * j + 1]
  end
end

-- One queue's packed increments "<prefix> <amount> ..." added to `fields` and `values`
-- as the fields "<prefix>:<queue>".
local function queue_fields(queue, packed, fields, values)
  for prefix, amount in string.gmatch(packed, '(%S+) (%S+)') do
    fields[#fields + 1], values[#values + 1] = prefix .. ':' .. queue, amount
  end
end

-- A counter plus an amount, as HINCRBY adds: a value that is not an integer is left to
-- HINCRBY (which refuses it, as it did when every counter was added by HINCRBY), and so
-- is a sum past what a double holds exactly (a queue's total runtime in µs).
local function add(old, amount)
  local a, b = tonumber(old or 0), tonumber(amount)
  if not (a and b) or a % 1 ~= 0 or math.abs(a) >= EXACT or math.abs(a + b) >= EXACT then
    return nil
  end
  return string.format('%.0f', a + b)
end

if mode == 'count' then
  local s, r, q = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
  local sf, sv, rf, rv, named = {}, {}, {}, {}, {}
  pairs_from(8, s, sf, sv)
  pairs_from(8 + 2 * s, r, rf, rv)
  local at = 8 + 2 * s + 2 * r
  for i = at, at + 3 * (q - 1), 3 do
    local queue = ARGV[i]
    if ARGV[i + 1] ~= '' then
      named[#named + 1] = queue
      queue_fields(queue, ARGV[i + 1], sf, sv)
    end
    queue_fields(queue, ARGV[i + 2], rf, rv)
  end
  update(KEYS[7], sf, sv, add)
  update(KEYS[8], rf, rv, add)
  for i = 1, #named, CHUNK do
    redis.call('SADD', KEYS[9], unpack(named, i, math.min(i + CHUNK - 1, #named)))
  end
  first = at + 3 * q
end
local now = clock_ms()
local minute = math.floor(now / 60000)
local slot = minute - guess + 2
if slot < 1 or slot > 3 then
  return {0, now}
end
local minuteKey, hourKey = KEYS[slot], KEYS[slot + 3]
local hour = math.floor(minute / 60)

-- A field's value plus "<p> <f> <r> <i>:<n> ...", with string matches, no tables: the
-- field is new (stored as given) or holds a few buckets, one or two of which the increment
-- adds to (a new bucket goes at the end: readers do not need them in order). A value
-- that is not of this form (the field is readable by anyone) is replaced.
local function merge(old, increment)
  local p, f, r, rest
  if old then p, f, r, rest = string.match(old, '^(%d+) (%d+) (%d+)(.*)$') end
  if not p then return increment end
  local ap, af, ar, more = string.match(increment, '^(%d+) (%d+) (%d+)(.*)$')
  for i, n in string.gmatch(more, '(%d+):(%d+)') do
    local found
    rest, found = string.gsub(rest, '( ' .. i .. ':)(%d+)',
      function(at, m) return at .. (tonumber(m) + tonumber(n)) end, 1)
    if found == 0 then rest = rest .. ' ' .. i .. ':' .. n end
  end
  return (p + ap) .. ' ' .. (f + af) .. ' ' .. (r + ar) .. rest
end

local history_fields, history_values = {}, {}
if mode == 'count' then
  pairs_from(first, (#ARGV - first + 1) / 2, history_fields, history_values)
end
for _, key in ipairs({minuteKey, hourKey}) do
  if mode == 'gauge' then
    redis.call('HSET', key, 'q', ARGV[5])
  else
    update(key, history_fields, history_values, merge)
  end
end
redis.call('PEXPIREAT', minuteKey, (minute + 1) * 60000 + minuteTtlMs)
redis.call('PEXPIREAT', hourKey, (hour + 1) * 3600000 + hourTtlMs)
return {1, now}
