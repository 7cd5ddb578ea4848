#!lua flags=allow-oom
-- fetch: move jobs from job queues into a pool's in-flight record, one round trip.
-- The pool's weighted round-robin picks the candidate queues; this script pops
-- one job per candidate, atomically recording it as owned by the pool: the oldest
-- job of the candidate's first non-empty priority level (see priority.py).
-- KEYS[1]  in-flight hash of the pool   {ns}:inflight:<pool id>
-- KEYS[2]  pools zset                   {ns}:pools
-- KEYS[3]  ready set                    {ns}:ready
-- KEYS[4]  redelivery hash              {ns}:redelivery
-- KEYS[5]  in-flight pools set          {ns}:inflight_pools
-- KEYS[6]  running counts hash          {ns}:running
-- KEYS[7]  concurrency limits hash      {ns}:limits
-- KEYS[8]  paused queues set            {ns}:paused
-- KEYS[9]  rate limits hash             {ns}:rate_limits
-- KEYS[10] rate limit state hash        {ns}:rate_tat
-- KEYS[11] stats hash                   {ns}:stats
-- KEYS[12] job index hash               {ns}:jobs (include/job_index.lua)
-- KEYS[13] revoked ids zset             {ns}:revoked (include/revoked.lua)
-- KEYS[14] revokes' meta hash           {ns}:revoked_by
-- KEYS[15] dead zset                    {ns}:dead
-- KEYS[16] dead jobs hash               {ns}:dead_jobs
-- KEYS[17] finished index entries       {ns}:jobs_done
-- KEYS[18..] job queue lists, L per candidate (repeats allowed): one per priority
--          level, the level that runs first first (L = (#KEYS - 17) / candidates)
-- ARGV[1]  pool id
-- ARGV[2]  one char per candidate: "1" = record in-flight (acked consumer), "0" = no-ack
-- ARGV[3..] queue names, one per candidate, in the order of the KEYS[18..] groups
-- ARGV[3 + n] (optional, n = number of candidates) max_payload_bytes, 0 = no limit
-- ARGV[4 + n] (optional) "1" = keep the job index: a job dropped as revoked gets its
--          entry saying dead, a no-ack delivery's queued entry goes. A tracked job's
--          entry is not touched: it says queued with the job's delivery tag, and this
--          script's record of the job in KEYS[1] under that tag is what says it is in
--          flight (include/job_index.lua), so the fetch's cost does not grow with the
--          index (a hash of every queued job: a random field of it is out of cache)
-- ARGV[5 + n] (optional) max dead jobs kept (default 10000)
-- ARGV[6 + n] (optional) max age of dead jobs, ms (default: no age rule)
-- ARGV[7 + n] (optional) unique lock key prefix {ns}:unique:, ARGV[8 + n] (optional)
--          cursor key prefix {ns}:cursor: (include/unique.lua, include/cursor.lua): a
--          job dropped as revoked releases the lock it holds and loses its cursor
-- A popped job whose task id is revoked (KEYS[13], while its revoke holds) is not
-- delivered nor recorded in flight: it goes to the dead set, reason "revoked", with the
-- revoke's meta (who, when), and its index entry says dead. One ZSCORE per job while
-- any id is revoked, nothing more when none is. The candidate yields no job this call.
-- Its unique lock (either mode, if it holds it) and its cursor go with it.
-- Delivery tag: read from the payload's last bytes (include/delivery_tag.lua); a job
-- without one (another client's layout) gets "untagged-<sha1 ...>", the same on every
-- fetch, so its recovery count holds across requeues; a duplicate gets a "~<n>"
-- suffix as below.
-- A tracked job over max_payload_bytes is recorded in flight as usual, but its
-- payload is not shipped: the reply carries its size (an integer) instead, and the
-- worker moves it to the dead set (reason too_large).
-- A paused queue, or one with as many jobs in flight (in all pools) as its
-- max_concurrency, is skipped and reported as blocked; it stays in the ready set
-- (ack and resume publish the wake channel when it becomes fetchable again).
-- A rate-limited queue (rate_limits.py) is fetchable from its theoretical arrival time
-- (GCRA, Redis TIME): each job fetched pushes that time one interval past the later of
-- itself and now, so no two jobs are fetched less than an interval apart in all pools.
-- A queue not due yet is skipped, reported as blocked, counted in the stats, and its
-- wait returned, so the pool sleeps until then instead of polling. A queue a job held
-- (raise Throttled, throttle.lua: its field in KEYS[10], with or without a rate limit)
-- is skipped the same way until then, not counted; without a rate limit, the first
-- fetch that finds the hold over removes its field. A wait is at most
-- MAX_WAIT_US (one day, the longest interval rate_limits.py accepts): an interval
-- stored out of that range would otherwise overflow the integer reply.
-- Fair shares (include/fair.lua, fair.py): when a candidate's level lists are empty, its keyed
-- jobs are served one key per pop, in the order of its ring of active keys, which each
-- pop rotates (LMOVE head to tail): a key with 10,000 jobs and a key with one get one
-- turn each per round. A key with as many jobs in flight as the queue's per-key limit
-- is passed over (at most FAIR_TRIES keys per pop); when every key tried is at its
-- limit the queue is reported blocked (ack wakes pools when a key drops below it).
-- A key not due yet (include/fair.lua's fair_due: its per-key rate limit, the field
-- "<queue>\n" of KEYS[9], GCRA as for a queue, or a hold a job of the key asked for)
-- is passed over the same way; when no key tried could be served and some were not
-- due, the earliest of their waits is returned with the queue, so the pool sleeps
-- until then. A key's job fetched under a per-key rate limit moves the key's state one
-- interval past now (the state expires when it is due: an idle key leaves nothing).
-- A key leaves the ring with its sub-queue's last job. Keyed jobs of a queue come
-- after its unkeyed ones.
-- Returns {status, jobs, empties, blocked, waits}: status 0 = pool not registered (nothing
-- moved), 1 = ok; jobs = {{queue, delivery tag, payload (or its size in bytes when
-- over the limit), recoveries or -1}, ...};
-- empties = names of candidate queues found or left empty; blocked = names of
-- candidate queues skipped (paused, at their limit or not due) or left at their limit
-- or not due; waits = {{queue name, µs until its next job is due}, ...}; and, only when
-- jobs were dropped as revoked, a sixth element: their task ids (the worker marks their
-- results revoked, as Celery does for a revoked job it receives).
local FAIR_TRIES = 8
local MAX_WAIT_US = 86400000000
local NFIXED = 17
local flags = ARGV[2]
local ncand = #flags
-- Lists per candidate, one per priority level: the first non-empty one is popped.
local nlev = ncand > 0 and (#KEYS - NFIXED) / ncand or 1
local max_payload = tonumber(ARGV[3 + ncand] or 0) or 0
local indexed = ARGV[4 + ncand] == '1'
local dead_max = tonumber(ARGV[5 + ncand] or '') or 10000
local dead_age = tonumber(ARGV[6 + ncand] or '')
local unique_prefix, cursor_prefix = ARGV[7 + ncand], ARGV[8 + ncand]
-- @include clock
-- @include job_index
-- @include revoked
-- @include dead_set
-- @include unique
-- @include cursor

-- @include delivery_tag
-- Per queue name, the first level (1 = the first) that may hold jobs: the levels
-- before it were found empty by an earlier candidate of this call.
local level_from = {}
-- Pop the next job of the candidate whose level lists follow KEYS[first]: the
-- first non-empty level's oldest job. Returns it and the index of its list.
local function pop(first, qname)
  for j = first + (level_from[qname] or 1), first + nlev do
    local payload = redis.call('RPOP', KEYS[j])
    if payload then
      level_from[qname] = j - first
      return payload, j
    end
  end
  level_from[qname] = nlev + 1
  return nil, first + nlev + 1
end
-- Whether every level list from KEYS[from] to the candidate's last is empty (the
-- levels before the one just popped were empty already), and no fair key has jobs: one
-- EXISTS of those lists and the fair ring (an empty list is no key), not an LLEN each.
-- A job that empties its queue (many job queues of a job or two each: half the jobs)
-- paid an LLEN per level (four by default) and the EXISTS: five of its eleven commands.
local function drained(from, first)
  local ring = KEYS[first + 1] .. '\6\23'
  return redis.call('EXISTS', ring, unpack(KEYS, from, first + nlev)) == 0
end
-- @include fair
-- Per queue name, its per-key limit and its per-key rate limit (µs; false: none), read
-- once per call (`limited`, `rated`: the limits hashes have any field at all).
local fair_limits, fair_rates = {}, {}
-- Pop the next keyed job of the candidate whose level lists follow KEYS[first] (see
-- above). Returns its payload, its fair key and whether its queue may have no job
-- left; or nil, nil, whether keys with jobs are left (all passed over: at their limit
-- or not due) and the µs until the first key passed over as not due is (nil: none).
local function fair_pop(first, qname, limited, rated)
  local qkey = KEYS[first + 1]
  local ring = qkey .. FAIR_SEP
  if fair_limits[qname] == nil then
    fair_limits[qname] = limited and tonumber(redis.call('HGET', KEYS[7], qname .. '\n'))
      or false
    fair_rates[qname] = rated and tonumber(redis.call('HGET', KEYS[9], qname .. '\n'))
      or false
  end
  local limit, rate, wait = fair_limits[qname], fair_rates[qname], nil
  -- Each key is tried at most once (a key may be held even without a limit).
  for _ = 1, math.min(redis.call('LLEN', ring), FAIR_TRIES) do
    local key = redis.call('LMOVE', ring, ring, 'LEFT', 'RIGHT')
    if not key then return nil, nil, false end
    if not limit
        or (tonumber(redis.call('HGET', KEYS[6], qname .. '\n' .. key)) or 0) < limit then
      local due = fair_due(qkey, key)
      if due > 0 and due > clock_us() then
        wait = math.min(wait or MAX_WAIT_US, due - clock_us())
      else
        local payload = redis.call('RPOP', ring .. key)
        local last = redis.call('LLEN', ring .. key) == 0
        if last then redis.call('RPOP', ring) end
        if payload then
          if rate then fair_hold(qkey, key, clock_us() + rate, clock_us(), due) end
          return payload, key, last
        end
      end
    end
  end
  return nil, nil, redis.call('EXISTS', ring) == 1, wait
end
if string.find(flags, '1', 1, true) and not redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  return {0, {}, {}, {}, {}}
end
local limited = redis.call('HLEN', KEYS[7]) > 0
local any_paused = redis.call('SCARD', KEYS[8]) > 0
local jobs, empties, blocked, skip, checked, room = {}, {}, {}, {}, {}, {}
local rated, interval, tat, waits, now_us = redis.call('HLEN', KEYS[9]) > 0, {}, {}, {}, 0
-- A queue may be held without a rate limit (a job raised Throttled: throttle.lua).
local holds = redis.call('HLEN', KEYS[10]) > 0
if rated or holds then
  now_us = clock_us()
end
local tracked = false
local any_revoked = redis.call('EXISTS', KEYS[13]) == 1
local dropped = {}
for i = 1, ncand do
  local first, qname = NFIXED + (i - 1) * nlev, ARGV[2 + i]
  if not skip[qname] and not checked[qname] then
    checked[qname] = true
    if any_paused and redis.call('SISMEMBER', KEYS[8], qname) == 1 then
      skip[qname] = true
    elseif limited then
      local limit = tonumber(redis.call('HGET', KEYS[7], qname))
      if limit then
        room[qname] = limit - tonumber(redis.call('HGET', KEYS[6], qname) or 0)
      end
    end
    if rated and not skip[qname] then
      interval[qname] = tonumber(redis.call('HGET', KEYS[9], qname))
    end
  end
  if not skip[qname] and room[qname] and room[qname] <= 0 then
    skip[qname] = true
  end
  if not skip[qname] and (interval[qname] or holds) then
    tat[qname] = tat[qname] or tonumber(redis.call('HGET', KEYS[10], qname) or 0)
    if tat[qname] > now_us then
      skip[qname] = true
      waits[#waits + 1] = {qname, math.min(tat[qname] - now_us, MAX_WAIT_US)}
      if interval[qname] then
        redis.call('HINCRBY', KEYS[11], 'rate_limited', 1)
        redis.call('HINCRBY', KEYS[11], 'rate_limited:' .. qname, 1)
      end
    elseif tat[qname] > 0 and not interval[qname] then
      -- A hold that is over, on a queue without a rate limit: nothing is left of it.
      redis.call('HDEL', KEYS[10], qname)
      tat[qname] = 0
    end
  end
  if skip[qname] == true then
    skip[qname] = 'reported'
    blocked[#blocked + 1] = qname
  end
  if not skip[qname] then
    local payload, at = pop(first, qname)
    local fkey, fair_left, fair_wait
    if not payload then
      payload, fkey, fair_left, fair_wait = fair_pop(first, qname, limited, rated)
      -- A keyed job whose key has more: its ring is not empty, the queue not drained.
      if payload and not fair_left then at = nil end
    end
    if not payload and fair_left then
      skip[qname] = 'reported'
      blocked[#blocked + 1] = qname
      if fair_wait then waits[#waits + 1] = {qname, fair_wait} end
    elseif not payload then
      skip[qname] = 'empty'
      empties[#empties + 1] = qname
      redis.call('SREM', KEYS[3], qname)
    else
      local tid = any_revoked and jix_task_id(payload)
      local rmeta = tid and revoked_meta(KEYS[13], KEYS[14], tid)
      if rmeta then
        local rtag = tag_of(payload)
        redis.call('HDEL', KEYS[4], rtag)  -- (a recovered job's count goes with it)
        local did = dead_add(KEYS[15], KEYS[16], rtag, rmeta .. '\n' .. qname .. '\n' .. payload)
        if indexed then jix_set(KEYS[12], tid, 'dead', qname, did, 'revoked') end
        dead_trim(KEYS[15], KEYS[16], KEYS[12], indexed and 1 or 0, dead_max, dead_age)
        unique_release_job(unique_prefix, payload, tid)
        cursor_drop(cursor_prefix, payload, nil)
        dropped[#dropped + 1] = tid
      else
        local tag = tag_of(payload)
        local track = string.sub(flags, i, i) == '1'
        if track then
          -- A tag this pool already owns (a duplicated or forged message) gets a
          -- suffix: overwriting would silently drop the other job's record. (The
          -- job index entry follows the copy under the payload's own tag.)
          local base, n = tag, 0
          while redis.call('HSETNX', KEYS[1], tag, qname .. '\n' .. payload) == 0 do
            n = n + 1
            tag = base .. '~' .. n
          end
          redis.call('HINCRBY', KEYS[6], qname, 1)
          if fkey then  -- counted with a per-key limit or not (include/fair.lua)
            redis.call('HINCRBY', KEYS[6], qname .. '\n' .. fkey, 1)
          end
          tracked = true
          if room[qname] then room[qname] = room[qname] - 1 end
        elseif indexed then
          jix_drop(KEYS[12], jix_task_id(payload), 'queued')  -- no-ack: delivered is gone
        end
        local rec = redis.call('HGET', KEYS[4], tag)
        if track and max_payload > 0 and #payload > max_payload then
          jobs[#jobs + 1] = {qname, tag, #payload, tonumber(rec or -1)}
        else
          jobs[#jobs + 1] = {qname, tag, payload, tonumber(rec or -1)}
        end
        if interval[qname] then
          tat[qname] = math.max(tat[qname], now_us) + interval[qname]
          redis.call('HSET', KEYS[10], qname, string.format('%.0f', tat[qname]))
        end
      end
      if at and drained(at, first) then
        skip[qname] = 'empty'
        empties[#empties + 1] = qname
        redis.call('SREM', KEYS[3], qname)
      elseif rmeta then
        -- (nothing was taken: the queue's limits and rate are as they were)
      elseif room[qname] and room[qname] <= 0 then
        skip[qname] = 'reported'
        blocked[#blocked + 1] = qname
      elseif interval[qname] then
        skip[qname] = 'reported'
        blocked[#blocked + 1] = qname
        waits[#waits + 1] = {qname, math.min(tat[qname] - now_us, MAX_WAIT_US)}
      end
    end
  end
end
if tracked then
  redis.call('SADD', KEYS[5], ARGV[1])
end
if #dropped > 0 then
  return {1, jobs, empties, blocked, waits, dropped}
end
return {1, jobs, empties, blocked, waits}
