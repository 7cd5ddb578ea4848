-- purge: empty a job queue (Kombu's purge and queue delete): every priority level
-- list, the fair ring and every fair sub-queue, and the job index entries of the jobs
-- they held, so that a purged job is not found "queued" afterwards.
-- KEYS[1]  ready set                    {ns}:ready
-- KEYS[2]  job index hash               {ns}:jobs
-- KEYS[3..] the queue's level lists, the default level (the queue key) first; the
--          fair ring and sub-queues are derived from it (include/fair.lua: same hash tag)
-- ARGV[1]  queue name
-- The index entries are removed only where they still say "queued" in this queue (a
-- copy of the job elsewhere keeps its own). Reading every job costs O(jobs purged),
-- in chunks; a queue without index entries (the index off) costs one LLEN per list.
-- Returns how many jobs were removed.
-- @include job_index
-- @include fair
local readyKey, indexKey, queueName = KEYS[1], KEYS[2], ARGV[1]
local CHUNK = 1000
local ring = KEYS[3] .. FAIR_SEP
local lists = {}
for i = 3, #KEYS do lists[#lists + 1] = KEYS[i] end
for _, key in ipairs(redis.call('LRANGE', ring, 0, -1)) do lists[#lists + 1] = ring .. key end
local indexed = redis.call('HLEN', indexKey) > 0
local removed = 0
for _, list in ipairs(lists) do
  local n = redis.call('LLEN', list)
  removed = removed + n
  if indexed then
    for from = 0, n - 1, CHUNK do
      for _, payload in ipairs(redis.call('LRANGE', list, from, from + CHUNK - 1)) do
        local id = jix_task_id(payload)
        local entry = jix_get(indexKey, id)
        if entry and entry[1] == 'queued' and entry[3] == queueName then
          redis.call('HDEL', indexKey, id)
        end
      end
    end
  end
  redis.call('DEL', list)
end
redis.call('DEL', ring)
redis.call('SREM', readyKey, queueName)
return removed
