-- periodic_outcome: record the outcome of a periodic run on its entry's state, if the
-- entry still has one. A run that ends after its entry's state expired (the entry left
-- the schedule, its state kept 7 days) or was deleted does not make it again: made by
-- HSET it would have no TTL and never go away. A state that expires keeps its TTL.
-- KEYS[1]  entry state hash          {ns}:periodic:<name>
-- ARGV[1]  outcome: success, failure or retry
-- ARGV[2]  the run's job id
-- Returns 1 when recorded, 0 when the entry has no state.
local stateKey = KEYS[1]
local outcome, jobId = ARGV[1], ARGV[2]
if redis.call('EXISTS', stateKey) == 0 then
  return 0
end
redis.call('HSET', stateKey, 'outcome', outcome, 'outcome_job_id', jobId)
return 1
