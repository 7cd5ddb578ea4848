-- job_where: one job's job index entry, and the pool holding it when it is in flight, in
-- one atomic read (store/job_index.py's lookup). The fetch leaves a job's queued entry as
-- it is: the entry names the delivery tag, and the job is in flight while a pool's
-- in-flight hash holds that tag (include/job_index.lua). Read apart, a job acked between
-- the entry and the in-flight hashes would show queued; read here, it cannot.
-- KEYS[1]  job index hash               {ns}:jobs
-- KEYS[2]  in-flight pools set          {ns}:inflight_pools
-- ARGV[1]  task id
-- ARGV[2]  in-flight hash key prefix    {ns}:inflight: (a pool's hash: the prefix and its id)
-- Returns false when the job has no entry, else {entry, pool}: entry as stored
-- ("<state>\n<ms>\n<queue>\n<ref>\n<detail>"), pool = the id of a pool whose in-flight
-- hash holds the tag of a queued entry, "" for any other entry or when none does. One
-- SMEMBERS and one HEXISTS per pool that may own jobs, for a queued entry only.
-- @include job_index
local idxKey, poolsKey = KEYS[1], KEYS[2]
local taskId, inflightPrefix = ARGV[1], ARGV[2]
local entry = redis.call('HGET', idxKey, taskId)
if not entry then return false end
local pool = ''
if string.sub(entry, 1, 7) == 'queued\n' then
  local tag = string.match(entry, '\n([^\n]*)$')
  pool = jix_pool_of(poolsKey, inflightPrefix, tag) or ''
end
return {entry, pool}
