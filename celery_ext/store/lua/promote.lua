-- promote: move due jobs from the scheduled and retry sets to their job queues,
-- then report which jobs are due next. Called by every pool's requeuer; ZREM
-- decides which caller moves a job, so each job is promoted exactly once.
-- Scheduled jobs go to the BACK of their queue (enqueued at their due time);
-- retries go to the FRONT (they already waited their turn once); both to the list
-- of their priority level, which the caller works out from the candidate's priority.
-- Scripts may only touch keys they are given, so a call moves the candidates the
-- previous call reported (their queue keys in KEYS[6..]) and peeks at the next.
-- KEYS[1]  scheduled zset               {ns}:scheduled
-- KEYS[2]  retry zset                   {ns}:retry
-- KEYS[3]  scheduled jobs hash          {ns}:scheduled_jobs
-- KEYS[4]  ready set                    {ns}:ready
-- KEYS[5]  known queues set             {ns}:queues
-- KEYS[6]  requeuer lease               {ns}:requeuer
-- KEYS[7]  job index hash               {ns}:jobs
-- KEYS[8]  finished index entries       {ns}:jobs_done
-- KEYS[9..] job queue lists, one per candidate: the list of its priority level
--          (a job with a fair key goes to its key's sub-queue of that queue instead, include/fair.lua)
-- ARGV[1]  wake channel                 {ns}:wake
-- ARGV[2]  job queue key prefix         {ns}:queue:
-- ARGV[3]  most candidates to report per set
-- ARGV[4]  the caller's requeuer id
-- ARGV[5]  lease time in ms
-- ARGV[6]  job index TTL of finished entries in ms, "0" = no index (include/job_index.lua)
-- ARGV[7..] candidates, two values each: set ("s" or "r") and job id, in the
--          order of KEYS[9..]
-- Every caller may move due jobs; the lease only says which requeuer is the
-- leader (the one that wakes for every due time, while the others make a pass
-- now and then in case it died). The caller takes the lease if it is free or its
-- own, and keeps it by calling again before it expires.
-- A candidate that is gone (promoted by another pool) or not due is skipped; one
-- whose record names another queue than its key is left for the next call.
-- Returns {moved, candidates, next due in ms, leader}: candidates = {set, id,
-- queue, priority, ...} of jobs due now (priority: the "priority" of the record's
-- meta, written by the producer when not 0, see scheduled.py; else 0); next due in
-- ms = time until the earliest job not yet due, or -1 when both sets are empty;
-- leader = 1 if the caller holds the lease.
-- @include clock
local now = clock_ms()
local sets = {s = KEYS[1], r = KEYS[2]}
local leader = 0
local holder = redis.call('GET', KEYS[6])
if not holder or holder == ARGV[4] then
  redis.call('SET', KEYS[6], ARGV[4], 'PX', ARGV[5])
  leader = 1
end

local function parse(rec)
  local nl1 = string.find(rec, '\n', 1, true)
  local nl2 = string.find(rec, '\n', nl1 + 1, true)
  return string.sub(rec, nl1 + 1, nl2 - 1), nl2, nl1
end
-- @include priority

local indexTtl = tonumber(ARGV[6])
-- @include job_index
-- @include delivery_tag
-- @include fair
local moved = 0
for i = 9, #KEYS do
  local which, id = ARGV[7 + (i - 9) * 2], ARGV[8 + (i - 9) * 2]
  local zkey = sets[which]
  local score = zkey and redis.call('ZSCORE', zkey, id)
  if score and tonumber(score) <= now then
    local rec = redis.call('HGET', KEYS[3], id)
    if not rec then
      redis.call('ZREM', zkey, id)  -- an orphan entry: nothing to run
    else
      local qname, nl2 = parse(rec)
      if is_level_of(KEYS[i], ARGV[2] .. qname) then
        redis.call('ZREM', zkey, id)
        redis.call('HDEL', KEYS[3], id)
        local payload = string.sub(rec, nl2 + 1)
        if indexTtl > 0 then
          local tid = jix_task_id(payload)
          if jix_is(KEYS[7], tid, nil, id) then
            jix_set(KEYS[7], tid, 'queued', qname, jix_level(KEYS[i]), tag_of(payload))
          end
        end
        local key = fair_of(payload)
        if key then
          fair_push(ARGV[2] .. qname, key, payload, which == 'r')
        elseif which == 'r' then
          redis.call('RPUSH', KEYS[i], payload)
        else
          redis.call('LPUSH', KEYS[i], payload)
        end
        redis.call('SADD', KEYS[5], qname)
        if redis.call('SADD', KEYS[4], qname) == 1 then
          redis.call('PUBLISH', ARGV[1], qname)
        end
        moved = moved + 1
      end
    end
  end
end

local candidates = {}
local next_due = -1
for _, which in ipairs({'s', 'r'}) do
  local zkey = sets[which]
  local ids = redis.call('ZRANGE', zkey, '-inf', now, 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[3]))
  for _, id in ipairs(ids) do
    local rec = redis.call('HGET', KEYS[3], id)
    local qname, priority = '', 0
    if rec then
      local _, nl1
      qname, _, nl1 = parse(rec)
      -- The meta is JSON: a quote inside a string is escaped, so this is its key.
      local meta = string.sub(rec, 1, nl1 - 1)
      priority = tonumber(string.match(meta, '"priority": *(%d+)')) or 0
    end
    candidates[#candidates + 1] = which
    candidates[#candidates + 1] = id
    candidates[#candidates + 1] = qname
    candidates[#candidates + 1] = priority
  end
  local head = redis.call('ZRANGE', zkey, '(' .. now, '+inf', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
  if head[2] then
    local wait = tonumber(head[2]) - now
    if next_due < 0 or wait < next_due then next_due = wait end
  end
end
return {moved, candidates, next_due, leader}
