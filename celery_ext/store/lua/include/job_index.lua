-- job index fragment: pasted by the loader (scripts.py) where a script says
-- "-- @include job_index". Every script that moves a job writes where it is now:
-- {ns}:jobs            hash  task id -> "<state>\n<ms>\n<queue>\n<ref>\n<detail>", and for a
--                       done entry "\n<queued ms>" after it: when the run it ended was
--                       queued (job_status.py tells this run's outcome from an older one
--                       by it; the ack may come long after the outcome was stored)
-- {ns}:jobs_done       zset  task id -> ms after which its finished entry is trimmed
-- state / ref / detail: queued / priority level / delivery tag; scheduled, retry / job id /
-- due ms; dead / dead job id / reason; done / delivery tag / pool id; and, written by a
-- worker of an earlier version only, inflight / delivery tag / pool id. The calling script
-- is given both keys and the TTL of finished entries in ms ("0" = the index is off:
-- nothing is read or written).
-- The fetch leaves the entry alone: a job in flight keeps its queued entry, whose tag is
-- the key of its record in the pool's in-flight hash (the fetch records the payload's
-- tag, include/delivery_tag.lua), so the fetch's cost does not depend on the size of the
-- index. A "queued" entry whose tag a pool's in-flight hash holds is that job in flight
-- (jix_owns, jix_pool_of); readers resolve it with job_where.lua.
-- The task id: Celery's correlation_id, which Kombu writes in "properties", last, so it
-- is read from the payload's last bytes (O(1) whatever the body); another layout falls
-- back to the "id" of "headers": a compact message (store/compact.py) drops a
-- correlation_id equal to the id and writes "headers" first, so it is found at once;
-- another client's layout costs a scan. nil when neither is there.
local function jix_task_id(payload)
  local from = math.max(1, #payload - 1023)
  local _, e = string.find(payload, '"correlation_id": "', from, true)
  if not e then
    local _, h = string.find(payload, '"headers": {', 1, true)
    if not h then return nil end
    _, e = string.find(payload, '"id": "', h, true)
    if not e then return nil end
  end
  local q = string.find(payload, '"', e + 1, true)
  if not q or q == e + 1 then return nil end
  return string.sub(payload, e + 1, q - 1)
end
-- The payload of a "<...>\n<queue>\n<payload>" record whose payload follows the
-- newline at or after `from`.
local function jix_payload_after(rec, from)
  local nl = string.find(rec, '\n', from, true)
  return nl and string.sub(rec, nl + 1) or rec
end
-- The priority level of a job queue level list key ("\6\22<level>" suffix, keys.py).
local function jix_level(key)
  return string.match(key, '\6\22(%d+)$') or '0'
end
-- {state, ms, queue, ref, detail} of a job's entry, or nil (also for no task id).
local function jix_get(idx, id)
  if not id then return nil end
  local e = redis.call('HGET', idx, id)
  if not e then return nil end
  local f = {}
  for part in string.gmatch(e .. '\n', '([^\n]*)\n') do f[#f + 1] = part end
  return f
end
-- Whether the entry `f` names the copy of its job in flight under `tag`: queued with
-- that tag, or in the earlier format inflight with it. Exact: a duplicate fetched into
-- the same pool under "<tag>~<n>" is not the copy the entry follows.
local function jix_names(f, tag)
  return (f[1] == 'queued' and f[5] == tag) or (f[1] == 'inflight' and f[4] == tag)
end
-- Whether the entry of `id` is missing or names the copy in flight under `tag` (above):
-- the checks of the scripts that move an in-flight job (ack, requeue, recover, dead,
-- throttle), so a move never overwrites the entry of another copy.
-- The entry read is returned second.
local function jix_owns(idx, id, tag)
  local f = jix_get(idx, id)
  return not f or jix_names(f, tag), f
end
-- The id of a pool whose in-flight hash ("<prefix><pool id>", keys.py) holds `tag`, from
-- the pools that may own jobs (`pools`, {ns}:inflight_pools), or nil. One HEXISTS per
-- such pool: for readers and revoke, not for the fetch.
local function jix_pool_of(pools, prefix, tag)
  if not tag or tag == '' then return nil end
  for _, pool in ipairs(redis.call('SMEMBERS', pools)) do
    if redis.call('HEXISTS', prefix .. pool, tag) == 1 then return pool end
  end
  return nil
end
-- Whether the entry of `id` is missing or still says `state` with `ref` (any when nil):
-- a move of one copy of a job never overwrites the entry of a newer copy (a Celery
-- retry is scheduled under the same task id before the failed run is acked).
local function jix_is(idx, id, state, ref)
  local f = jix_get(idx, id)
  return not f or ((not state or f[1] == state) and (not ref or f[4] == ref)), f
end
local function jix_set(idx, id, state, queue, ref, detail, queued_ms)
  if not id then return end
  redis.call('HSET', idx, id, state .. '\n' .. clock_ms() .. '\n' .. queue .. '\n'
             .. (ref or '') .. '\n' .. (detail or '')
             .. (queued_ms and ('\n' .. queued_ms) or ''))
end
-- Trim up to `limit` finished entries whose time in `done` is up: an entry that still
-- says done is deleted once `ttl` ms have passed since its finish, or, finished later
-- than its time says (a TTL longer than the finisher's), kept under its new time; an
-- entry that became live again (a task id reused) or is gone only leaves `done`.
-- Returns how many members of `done` were handled.
local function jix_trim(idx, done, ttl, limit)
  local now = clock_ms()
  local old = redis.call('ZRANGE', done, '-inf', now, 'BYSCORE', 'LIMIT', 0, limit)
  for _, oid in ipairs(old) do
    local f = jix_get(idx, oid)
    local due = f and f[1] == 'done' and tonumber(f[2]) + ttl
    if due and due > now then
      redis.call('ZADD', done, due, oid)
    else
      if due then redis.call('HDEL', idx, oid) end
      redis.call('ZREM', done, oid)
    end
  end
  return #old
end
-- A finished job: the entry is kept ttl ms; each finish trims a few expired ones (and
-- the pools' periodic trim, job_index_trim.lua, the rest). `queued_ms`: the ms of the
-- entry the run was fetched under (the move that queued it), nil when it had none.
local function jix_finish(idx, done, ttl, id, queue, ref, detail, queued_ms)
  if not id then return end
  jix_set(idx, id, 'done', queue, ref, detail, queued_ms)
  redis.call('ZADD', done, clock_ms() + ttl, id)
  jix_trim(idx, done, ttl, 20)
end
-- A job deleted from a set: its entry goes if it still points at that record.
local function jix_drop(idx, id, state, ref)
  if id and jix_is(idx, id, state, ref) then
    redis.call('HDEL', idx, id)
  end
end
