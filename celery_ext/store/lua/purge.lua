-- purge: empty a job queue (Kombu's purge and queue delete): every priority level
-- list, the fair ring and every fair sub-queue, and what the jobs they held left
-- elsewhere: their job index entries, so that a purged job is not found "queued"
-- afterwards, and their recovery counts (a job requeued from a dead pool has one).
-- KEYS[1]  ready set                    {ns}:ready
-- KEYS[2]  job index hash               {ns}:jobs
-- KEYS[3]  redelivery hash              {ns}:redelivery
-- KEYS[4..] the queue's level lists, the default level (the queue key) first; the
--          fair ring and sub-queues are derived from it (include/fair.lua: same hash tag)
-- ARGV[1]  queue name
-- The index entries are removed only where they still say "queued" in this queue (a
-- copy of the job elsewhere keeps its own); a recovery count is removed by the job's
-- delivery tag (include/delivery_tag.lua). Reading every job costs O(jobs purged), in
-- chunks; a queue without index entries and without recovery counts (the index off)
-- costs one LLEN per list.
-- Returns how many jobs were removed.
-- @include clock
-- @include job_index
-- @include fair
-- @include delivery_tag
local readyKey, indexKey, redeliveryKey, queueName = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local CHUNK = 1000
local ring = KEYS[4] .. FAIR_SEP
local lists = {}
for i = 4, #KEYS do lists[#lists + 1] = KEYS[i] end
for _, key in ipairs(redis.call('LRANGE', ring, 0, -1)) do lists[#lists + 1] = ring .. key end
local indexed = redis.call('HLEN', indexKey) > 0
local counted = redis.call('HLEN', redeliveryKey) > 0
local removed = 0
for _, list in ipairs(lists) do
  local n = redis.call('LLEN', list)
  removed = removed + n
  if indexed or counted then
    for from = 0, n - 1, CHUNK do
      for _, payload in ipairs(redis.call('LRANGE', list, from, from + CHUNK - 1)) do
        if indexed then
          local id = jix_task_id(payload)
          local entry = jix_get(indexKey, id)
          if entry and entry[1] == 'queued' and entry[3] == queueName then
            redis.call('HDEL', indexKey, id)
          end
        end
        if counted then
          redis.call('HDEL', redeliveryKey, tag_of(payload))
        end
      end
    end
  end
  redis.call('DEL', list)
end
redis.call('DEL', ring)
redis.call('SREM', readyKey, queueName)
return removed
