-- periodic_lease: take, keep or give up the periodic leader's lease. The pool holding it
-- enqueues the periodic jobs (worker/periodic_leader.py); its life is the holder's own
-- dead_after, renewed by the holder at least every heartbeat interval.
-- KEYS[1]  lease                     {ns}:periodic_leader (the leading pool's id)
-- ARGV[1]  this pool's id
-- ARGV[2]  "hold" (take the lease if free, renew it if held) or "release"
-- ARGV[3]  (hold) the lease's life in ms: this pool's dead_after
-- ARGV[4]  (release) handover channel {ns}:periodic_handover (wakes the other pools)
-- Returns, for "hold": {1, life in ms} when this pool leads now, {0, ms until the
-- holder's lease runs out} when another pool leads; for "release": 1 when this pool
-- held the lease and gave it up, else 0.
local leaseKey = KEYS[1]
local poolId, mode, lifeMs, handoverChannel = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local holder = redis.call('GET', leaseKey)
if mode == 'release' then
  if holder ~= poolId then return 0 end
  redis.call('DEL', leaseKey)
  redis.call('PUBLISH', handoverChannel, poolId)
  return 1
end
if holder and holder ~= poolId then
  local leftMs = redis.call('PTTL', leaseKey)
  if leftMs >= 0 then
    return {0, leftMs}
  end  -- a lease without a life (not set by this script) would never pass on: taken
end
redis.call('SET', leaseKey, poolId, 'PX', lifeMs)
return {1, tonumber(lifeMs)}
