-- _clock: Redis TIME, the one clock (a line "-- @include clock", see scripts.py; before
-- "-- @include job_index", whose helpers stamp with it). TIME is read once per call of
-- the script, so every stamp one call writes is the same moment.
local clock_time = nil
-- Redis TIME as {seconds, microseconds}, read at the first call.
local function clock_read()
  if not clock_time then clock_time = redis.call('TIME') end
  return clock_time
end
-- Now, in ms since the epoch (Redis TIME).
local function clock_ms()
  local t = clock_read()
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Now, in µs since the epoch (Redis TIME): the rate limits' timing (fetch.lua).
local function clock_us()
  local t = clock_read()
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
