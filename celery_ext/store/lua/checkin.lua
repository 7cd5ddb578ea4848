-- checkin: a running job reports progress; the answer says whether it should stop.
-- KEYS[1]  checkins hash                {ns}:checkins
-- KEYS[2]  stop requests set            {ns}:stop
-- KEYS[3]  pool hash                    {ns}:pool:<pool id>
-- ARGV[1]  job id
-- ARGV[2]  checkin JSON (message, progress), one line
-- Returns {stop requested (0/1), pool state or false, now ms}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], now .. '\n' .. ARGV[2])
return {redis.call('SISMEMBER', KEYS[2], ARGV[1]), redis.call('HGET', KEYS[3], 'state'), now}
