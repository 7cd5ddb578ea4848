#!lua flags=allow-oom
-- job_index_trim: delete the job index's finished entries whose TTL has passed, a
-- bounded number per call: the periodic trim every worker pool's reaper runs on each
-- copy (store/job_index.py), so that entries expire when no later job of their queue
-- finishes (each finish trims a few too, include/job_index.lua). Runs on a full
-- Redis: it frees memory.
-- KEYS[1]  job index hash               {ns}:jobs
-- KEYS[2]  finished index entries       {ns}:jobs_done
-- ARGV[1]  job index TTL of finished entries in ms (> 0)
-- ARGV[2]  most finished entries handled by this call
-- Returns how many finished entries were handled (deleted, or kept under a later time).
-- @include clock
-- @include job_index
local indexKey, doneKey = KEYS[1], KEYS[2]
local ttl, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
return jix_trim(indexKey, doneKey, ttl, limit)
