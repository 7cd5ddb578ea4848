-- history: add job counts or a queue-size sample to the per-minute and per-hour
-- history (see celery_ext/history.py for the layout and the value format).
-- KEYS[1..3] minute hashes    {ns}:history:m:<minute> for minutes m-1, m, m+1
-- KEYS[4..6] hour hashes      {ns}:history:h:<hour> of those three minutes
-- ARGV[1]  m: the caller's guess of the current minute (ms since epoch // 60000)
-- ARGV[2]  mode: "count" (job counts, summed) or "gauge" (a sample, replaced)
-- ARGV[3]  ms a minute hash lives past the end of its minute
-- ARGV[4]  ms an hour hash lives past the end of its hour
-- ARGV[5..] count: pairs field ("n:<job name>", or "*" for all jobs), packed increments
--          "<processed> <failed> <retried> [<bucket>:<n> ...]";
--          gauge: one packed sample stored under the field "q"
-- The minute comes from Redis TIME: the caller passes the keys of three candidate
-- minutes (the Redis Cluster rule: a script touches only the keys it is given) and
-- the script writes to the one that is now. Returns {1, now ms} when written,
-- {0, now ms} when none of the three is now (the caller's clock is off: it corrects
-- its guess with the returned time and calls again).
-- @include clock
local guess, mode = tonumber(ARGV[1]), ARGV[2]
local minuteTtlMs, hourTtlMs = tonumber(ARGV[3]), tonumber(ARGV[4])
local now = clock_ms()
local minute = math.floor(now / 60000)
local slot = minute - guess + 2
if slot < 1 or slot > 3 then
  return {0, now}
end
local minuteKey, hourKey = KEYS[slot], KEYS[slot + 3]
local hour = math.floor(minute / 60)

-- "<p> <f> <r> <i>:<n> ..." -> {p, f, r}, {[i] = n}
local function parse(packed)
  local counts, buckets, k = {0, 0, 0}, {}, 0
  if packed then
    for word in string.gmatch(packed, '%S+') do
      k = k + 1
      if k <= 3 then
        counts[k] = tonumber(word) or 0
      else
        local i, n = string.match(word, '^(%d+):(%d+)$')
        if i then buckets[tonumber(i)] = tonumber(n) end
      end
    end
  end
  return counts, buckets
end

local function merge(key, field, increment)
  local counts, buckets = parse(redis.call('HGET', key, field))
  local addCounts, addBuckets = parse(increment)
  local out = {}
  for k = 1, 3 do out[k] = tostring(counts[k] + addCounts[k]) end
  for i, n in pairs(addBuckets) do buckets[i] = (buckets[i] or 0) + n end
  local order = {}
  for i in pairs(buckets) do order[#order + 1] = i end
  table.sort(order)
  for _, i in ipairs(order) do out[#out + 1] = i .. ':' .. buckets[i] end
  redis.call('HSET', key, field, table.concat(out, ' '))
end

for _, key in ipairs({minuteKey, hourKey}) do
  if mode == 'gauge' then
    redis.call('HSET', key, 'q', ARGV[5])
  else
    for i = 5, #ARGV, 2 do
      merge(key, ARGV[i], ARGV[i + 1])
    end
  end
end
redis.call('PEXPIREAT', minuteKey, (minute + 1) * 60000 + minuteTtlMs)
redis.call('PEXPIREAT', hourKey, (hour + 1) * 3600000 + hourTtlMs)
return {1, now}
