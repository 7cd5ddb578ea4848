#!lua flags=allow-oom
-- queue_info: size and oldest job's enqueue stamp of job queues, for the readers
-- (dashboard, CLI, client), and the one place the known queues set shrinks.
-- KEYS[1]  known queues set             {ns}:queues
-- KEYS[2]  ready set                    {ns}:ready
-- KEYS[3]  paused queues set            {ns}:paused
-- KEYS[4]  concurrency limits hash      {ns}:limits
-- KEYS[5]  weights hash                 {ns}:weights
-- KEYS[6]  running counts hash          {ns}:running
-- KEYS[7]  counters hash                {ns}:stats
-- KEYS[8]  runtime histogram hash       {ns}:runtime
-- KEYS[9..] job queue lists, L per name: one per priority level, the default
--          level's first (L = (#KEYS - 8) / number of names)
-- ARGV[1]  "1" = also read each queue's oldest enqueue stamp, "0" = sizes only
-- ARGV[2]  the per-queue field prefixes of the counters hash, space-separated
--          ("processed failed ..."; a queue's field is "<prefix>:<queue>")
-- ARGV[3]  the same for the runtime histogram hash ("0.005 0.01 ... sum_us")
-- ARGV[4]  one flag per name: "1" = a live worker pool consumes it (or the caller does
--          not know), "0" = none does
-- ARGV[5..] queue names, in the order of KEYS[9..]
-- A name is forgotten (removed from the known queues, and from the ready set if its
-- list is gone) when it is one of Kombu's remote-control reply queues ("*.pidbox", see enqueue.lua), or when
-- its list is gone (drained, deleted, expired) and nothing configures or uses it: not
-- paused, no max_concurrency, no weight written by a worker pool, no job in flight, no
-- live pool consuming it. Its fields of the running, counters and runtime hashes go with it, so
-- names that come and go leave nothing behind (a late counter flush adds the name again,
-- history.lua, and the next read forgets both).
-- A job in the scheduled or retry set brings its name back when it is promoted.
-- The stamp is the "enqueued_at" property, which producers write after the delivery
-- tag at the very end of the payload (see fetch.lua): only the last STAMP_WINDOW bytes
-- of the oldest job are searched and only the number is returned, never the payload.
-- Returns {now ms (Redis TIME), size, stamp, size, stamp, ...}, two values per name:
-- size = -1 for a name forgotten now, else the jobs of all its levels and of all its
-- fair keys' sub-queues (include/fair.lua: one LLEN per active key); stamp = the oldest job's
-- enqueued_at (the earliest of its levels' and sub-queues' oldest) as a string, '' when
-- the queue is empty, the stamp is missing, or it was not asked for.
-- @include clock
local STAMP_WINDOW = 1024
local known, ready, paused, limits, weights, running = KEYS[1], KEYS[2], KEYS[3], KEYS[4],
  KEYS[5], KEYS[6]
local stats, runtime = KEYS[7], KEYS[8]
local want_stamps = ARGV[1] == '1'
local consumed = ARGV[4]
local nnames = #ARGV - 4
local nlev = nnames > 0 and (#KEYS - 8) / nnames or 1

-- Delete a forgotten queue's fields "<prefix>:<name>" of one hash.
local function forget_fields(hash, prefixes, name)
  local fields = {}
  for prefix in string.gmatch(prefixes, '%S+') do
    fields[#fields + 1] = prefix .. ':' .. name
  end
  if #fields > 0 then redis.call('HDEL', hash, unpack(fields)) end
end

-- The last "enqueued_at" number in the last `window` bytes of a payload, or nil.
local function stamp_in(payload, window)
  local stamp, from = nil, math.max(1, #payload - window + 1)
  while true do
    local _, e = string.find(payload, '"enqueued_at": ', from, true)
    if not e then return stamp end
    stamp = string.match(payload, '^[%d%.eE%+%-]+', e + 1)
    from = e + 1
  end
end
local function stamp_of(payload)
  -- Our producers write it last, about 30 bytes before the end: look there first.
  return stamp_in(payload, 64) or stamp_in(payload, STAMP_WINDOW) or ''
end

local function in_use(n, name)
  return string.sub(consumed, n, n) ~= '0'
    or redis.call('SISMEMBER', paused, name) == 1
    or redis.call('HEXISTS', limits, name) == 1
    or redis.call('HEXISTS', weights, name) == 1
    or (tonumber(redis.call('HGET', running, name)) or 0) > 0
end

local out = {clock_ms()}
for n = 1, nnames do
  local first, name = 8 + (n - 1) * nlev, ARGV[n + 4]
  local size, sizes = 0, {}
  for j = first + 1, first + nlev do
    sizes[j] = redis.call('LLEN', KEYS[j])
    size = size + sizes[j]
  end
  local ring = KEYS[first + 1] .. '\6\23'
  local subs = redis.call('LRANGE', ring, 0, -1)
  for j, key in ipairs(subs) do
    subs[j] = ring .. key
    size = size + redis.call('LLEN', subs[j])
  end
  local stamp = ''
  if string.sub(name, -7) == '.pidbox' or (size == 0 and not in_use(n, name)) then
    redis.call('SREM', known, name)
    if size == 0 then redis.call('SREM', ready, name) end
    redis.call('HDEL', running, name)  -- its count of jobs in flight, 0 since the last ack
    forget_fields(stats, ARGV[2], name)
    forget_fields(runtime, ARGV[3], name)
    size = -1
  elseif size > 0 and want_stamps then
    for j = first + 1, first + nlev do
      if sizes[j] > 0 then
        local s = stamp_of(redis.call('LINDEX', KEYS[j], -1))
        if s ~= '' and (stamp == '' or tonumber(s) < tonumber(stamp)) then stamp = s end
      end
    end
    for _, sub in ipairs(subs) do
      local oldest = redis.call('LINDEX', sub, -1)
      local s = oldest and stamp_of(oldest) or ''
      if s ~= '' and (stamp == '' or tonumber(s) < tonumber(stamp)) then stamp = s end
    end
  end
  out[#out + 1] = size
  out[#out + 1] = stamp
end
return out
