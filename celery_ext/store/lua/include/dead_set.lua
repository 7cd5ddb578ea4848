-- _dead_set: the dead set's writes, shared by dead.lua and recover.lua (a line
-- "-- @include dead_set", after "-- @include clock" and "-- @include job_index", whose
-- helpers these call):
-- {ns}:dead        zset  dead job id -> failed_at (ms)
-- {ns}:dead_jobs   hash  dead job id -> "<meta json>\n<queue>\n<payload>"
-- Jobs that die in the same millisecond (one pipeline, one recovery of several poison
-- pills) are DEAD_TIE ms apart in the order they died, each after the newest already
-- there: the set's order, which a person reads newest first, and its trim, which drops
-- the oldest first, are the order of death (a member's name would order them at random).
-- 1/1024 ms is exact in a double score until the year 2248.
local DEAD_TIE = 1 / 1024

-- Record `record` under `id` (its delivery tag), or "<id>~<n>" when that id is dead
-- already (a duplicated message: both stay listed). Returns the id used.
local function dead_add(dead, records, id, record)
  local did, n = id, 0
  while redis.call('HEXISTS', records, did) == 1 do
    n = n + 1
    did = id .. '~' .. n
  end
  local at = clock_ms()
  local newest = redis.call('ZRANGE', dead, -1, -1, 'WITHSCORES')
  if newest[2] and tonumber(newest[2]) >= at then
    at = tonumber(newest[2]) + DEAD_TIE
  end
  redis.call('HSET', records, did, record)
  redis.call('ZADD', dead, at, did)
  return did
end

-- Remove one dead job, and its job index entry if that still points at it.
local function dead_forget(dead, records, idx, indexTtl, did)
  if indexTtl > 0 then
    local drec = redis.call('HGET', records, did)
    if drec then
      jix_drop(idx, jix_task_id(jix_payload_after(drec, string.find(drec, '\n', 1, true) + 1)),
               'dead', did)
    end
  end
  redis.call('HDEL', records, did)
  redis.call('ZREM', dead, did)
end

-- Trim the dead set, oldest first, with bounded work per call (100 jobs per rule): the
-- jobs older than maxAgeMs (nil: no age rule), then those beyond maxKept.
local function dead_trim(dead, records, idx, indexTtl, maxKept, maxAgeMs)
  if maxAgeMs then
    local old = redis.call('ZRANGE', dead, '-inf', clock_ms() - maxAgeMs, 'BYSCORE',
                           'LIMIT', 0, 100)
    for _, did in ipairs(old) do dead_forget(dead, records, idx, indexTtl, did) end
  end
  local over = redis.call('ZCARD', dead) - maxKept
  if over > 0 then
    local ids = redis.call('ZRANGE', dead, 0, math.min(over, 100) - 1)
    for _, did in ipairs(ids) do dead_forget(dead, records, idx, indexTtl, did) end
  end
end
