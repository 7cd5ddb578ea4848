-- checkin: a running job reports progress; the answer says whether it should stop.
-- KEYS[1]  checkins hash                {ns}:checkins
-- KEYS[2]  stop requests zset           {ns}:stop_requests: job id -> ms the request lapses
-- KEYS[3]  pool hash                    {ns}:pool:<pool id>
-- ARGV[1]  job id
-- ARGV[2]  checkin JSON (message, progress), one line
-- Returns {stop requested and not lapsed (0/1), pool state or false, now ms}.
-- @include clock
local checkins, stopRequests, poolKey = KEYS[1], KEYS[2], KEYS[3]
local jobId, checkin = ARGV[1], ARGV[2]
local now = clock_ms()
redis.call('HSET', checkins, jobId, now .. '\n' .. checkin)
local lapsesAt = redis.call('ZSCORE', stopRequests, jobId)
local stop = 0
if lapsesAt and tonumber(lapsesAt) > now then stop = 1 end
return {stop, redis.call('HGET', poolKey, 'state'), now}
