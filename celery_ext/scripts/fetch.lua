#!lua flags=allow-oom
-- fetch: move jobs from job queues into a pool's in-flight record, one round trip.
-- The pool's weighted round-robin picks the candidate queues; this script pops
-- one job per candidate, atomically recording it as owned by the pool.
-- KEYS[1]  in-flight hash of the pool   {ns}:inflight:<pool id>
-- KEYS[2]  pools zset                   {ns}:pools
-- KEYS[3]  ready set                    {ns}:ready
-- KEYS[4]  redelivery hash              {ns}:redelivery
-- KEYS[5]  in-flight pools set          {ns}:inflight_pools
-- KEYS[6]  running counts hash          {ns}:running
-- KEYS[7]  concurrency limits hash      {ns}:limits
-- KEYS[8]  paused queues set            {ns}:paused
-- KEYS[9..] job queue lists, one per candidate (repeats allowed)
-- ARGV[1]  pool id
-- ARGV[2]  one char per candidate: "1" = record in-flight (acked consumer), "0" = no-ack
-- ARGV[3..] queue names, one per candidate, in the order of KEYS[9..]
-- A paused queue, or one with as many jobs in flight (in all pools) as its
-- max_concurrency, is skipped and reported as blocked; it stays in the ready set
-- (ack and resume publish the wake channel when it becomes fetchable again).
-- Returns {status, jobs, empties, blocked}: status 0 = pool not registered (nothing
-- moved), 1 = ok; jobs = {{queue, delivery tag, payload, recoveries or -1}, ...};
-- empties = names of candidate queues found or left empty; blocked = names of
-- candidate queues skipped (paused or at their limit) or left at their limit.
local ncand = #KEYS - 8
local flags = ARGV[2]
if string.find(flags, '1', 1, true) and not redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  return {0, {}, {}, {}}
end
local limited = redis.call('HLEN', KEYS[7]) > 0
local any_paused = redis.call('SCARD', KEYS[8]) > 0
local jobs, empties, blocked, skip, checked, room = {}, {}, {}, {}, {}, {}
local now = nil
local tracked = false
for i = 1, ncand do
  local qkey, qname = KEYS[8 + i], ARGV[2 + i]
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
  end
  if not skip[qname] and room[qname] and room[qname] <= 0 then
    skip[qname] = true
  end
  if skip[qname] == true then
    skip[qname] = 'reported'
    blocked[#blocked + 1] = qname
  end
  if not skip[qname] then
    local payload = redis.call('RPOP', qkey)
    if not payload then
      skip[qname] = 'empty'
      empties[#empties + 1] = qname
      redis.call('SREM', KEYS[3], qname)
    else
      -- kombu puts properties last, so the last delivery_tag is the message's own.
      local tag = nil
      for t in string.gmatch(payload, '"delivery_tag": "([^"]*)"') do tag = t end
      if not tag or tag == '' then
        now = now or redis.call('TIME')
        tag = 'undecodable-' .. now[1] .. now[2] .. '-' .. i
      end
      if string.sub(flags, i, i) == '1' then
        -- A tag this pool already owns (a duplicated or forged message) gets a
        -- suffix: overwriting would silently drop the other job's record.
        local base, n = tag, 0
        while redis.call('HSETNX', KEYS[1], tag, qname .. '\n' .. payload) == 0 do
          n = n + 1
          tag = base .. '~' .. n
        end
        redis.call('HINCRBY', KEYS[6], qname, 1)
        tracked = true
        if room[qname] then room[qname] = room[qname] - 1 end
      end
      local rec = redis.call('HGET', KEYS[4], tag)
      jobs[#jobs + 1] = {qname, tag, payload, tonumber(rec or -1)}
      if redis.call('LLEN', qkey) == 0 then
        skip[qname] = 'empty'
        empties[#empties + 1] = qname
        redis.call('SREM', KEYS[3], qname)
      elseif room[qname] and room[qname] <= 0 then
        skip[qname] = 'reported'
        blocked[#blocked + 1] = qname
      end
    end
  end
end
if tracked then
  redis.call('SADD', KEYS[5], ARGV[1])
end
return {1, jobs, empties, blocked}
