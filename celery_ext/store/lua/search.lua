-- search: one bounded step of a filtered scan of the dead, scheduled or retry set.
-- KEYS[1]  the set's zset             {ns}:dead, {ns}:scheduled or {ns}:retry
-- KEYS[2]  its records hash           {ns}:dead_jobs or {ns}:scheduled_jobs
-- ARGV[1]  "1" = newest first (highest score first), "0" = oldest first
-- ARGV[2]  score to start from (inclusive; the cursor), or "+inf" / "-inf"
-- ARGV[3]  entries at that score to skip (scanned by the previous step)
-- ARGV[4]  score to stop at (inclusive: the far end of the time range)
-- ARGV[5]  most entries to scan in this step
-- ARGV[6]  most matches to return in this step
-- ARGV[7]  job name that must match exactly ("" = any)
-- ARGV[8]  error filter ("" = any): the record's exc_type, or a part of its error text
-- ARGV[9]  text that the job's message body must contain ("" = any)
-- ARGV[10] id of the last entry the previous step read ("" = none, for a cursor that
--          names none): entries at the start score up to it in set order are passed
--          over, however many others removed or added there meanwhile; ARGV[3] is then
--          where reading starts, once the entry before that place is found to be passed
-- ARGV[11..16] (with ARGV[9]) the text base64-encoded at the three byte alignments:
--          pattern, offset of its first character in a 4-character group, ... (see
--          search.py, the admin side); a candidate is decoded and compared in full
-- A record is "<meta json>\n<queue>\n<payload>"; the job name is meta.name, else the
-- payload's "task" header, else the queue; the body is the payload's "body" string
-- (base64 when the payload says so), or a compact payload's body (store/compact.py,
-- decoded as JSON). Only the meta line and compact payloads are decoded as JSON.
-- Returns {matches, next score, next skip, scanned, done, last id}: matches = {id, score,
-- ...}; the next step starts at (next score, next skip, last id: the last entry read);
-- done = 1 when the range is exhausted.
local zsetKey, recordsKey = KEYS[1], KEYS[2]
local newestFirst, start, skip, stop = ARGV[1] == '1', ARGV[2], tonumber(ARGV[3]), ARGV[4]
local chunk, wantMatches = tonumber(ARGV[5]), tonumber(ARGV[6])
local wantName, wantError, wantText = ARGV[7], ARGV[8], ARGV[9]
local afterId = ARGV[10]

local function entriesFrom(offset, count)
  if newestFirst then
    return redis.call('ZRANGE', zsetKey, start, stop, 'BYSCORE', 'REV', 'LIMIT', offset, count,
                      'WITHSCORES')
  end
  return redis.call('ZRANGE', zsetKey, start, stop, 'BYSCORE', 'LIMIT', offset, count,
                    'WITHSCORES')
end

-- Whether a sorts before b byte by byte, as a sorted set orders the members of one
-- score (Lua's "<" follows the server's locale).
local function bytesBefore(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end

-- Whether the entry id (at the start score) comes at or before afterId in set order.
local function passed(id)
  if id == afterId then return true end
  if newestFirst then return bytesBefore(afterId, id) end
  return bytesBefore(id, afterId)
end

-- The entries before place skip are all at the start score: if the last of them is
-- passed, so are they all, and reading starts there; else (entries before the cursor
-- were removed) from the start score's first entry.
local offset = skip
if afterId ~= '' and skip > 0 then
  local probe = entriesFrom(skip - 1, 1)
  if not (probe[1] and probe[2] == start and passed(probe[1])) then offset = 0 end
end
local entries = entriesFrom(offset, chunk)

local B64 = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/'
local b64value = {}
for i = 1, 64 do b64value[string.byte(B64, i)] = i - 1 end

-- Decode the base64 characters s[from .. from + count - 1] (count a multiple of 4).
local function decode(s, from, count)
  local out = {}
  for g = from, from + count - 4, 4 do
    local n, pad = 0, 0
    for j = 0, 3 do
      local c = string.byte(s, g + j)
      local v = c and b64value[c]
      if not v then
        if c == 61 then pad = pad + 1 else return nil end  -- '=' pads; anything else: not base64
        v = 0
      end
      n = n * 64 + v
    end
    local b1 = math.floor(n / 65536)
    local b2 = math.floor(n / 256) % 256
    local b3 = n % 256
    out[#out + 1] = string.char(b1)
    if pad < 2 then out[#out + 1] = string.char(b2) end
    if pad < 1 then out[#out + 1] = string.char(b3) end
  end
  return table.concat(out)
end

local function rawBodyOf(payload)
  local from = string.find(payload, '"body": "', 1, true)
  local skipLen = 9
  if not from then
    from = string.find(payload, '"body":"', 1, true)
    skipLen = 8
  end
  if not from then return nil end
  local first = from + skipLen
  local last = string.find(payload, '"', first, true)
  if not last then return nil end
  return string.sub(payload, first, last - 1)
end

local function base64Body(payload)
  return string.find(payload, '"body_encoding": "base64"', 1, true)
      or string.find(payload, '"body_encoding":"base64"', 1, true)
end

-- A compact payload (store/compact.py) starts with its marker; it is decoded whole:
-- its "text" is the body decoded (JSON text, escaped in the payload), its "args" that
-- text without the end of a body without callbacks (NO_CALLBACKS in compact.py), its
-- "body" is base64 when its properties say so or dropped body_encoding at its default
-- ("p" flag).
local COMPACT_START = '{"c": "'
local NO_CALLBACKS = ', {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'
local function compactBodyOf(payload)
  local ok, m = pcall(cjson.decode, payload)
  if not ok or type(m) ~= 'table' or type(m.c) ~= 'string' then return nil end
  local flags = m.c
  if flags == 'whole' then
    m, flags = m.message, ''
    if type(m) ~= 'table' then return nil end
  end
  if type(m.args) == 'string' then return m.args .. NO_CALLBACKS, false end
  if type(m.text) == 'string' then return m.text, false end
  if type(m.body) ~= 'string' then return nil end
  local props = type(m.properties) == 'table' and m.properties or {}
  local encoding = props.body_encoding
  if encoding == nil and string.find(flags, 'p', 1, true) then encoding = 'base64' end
  return m.body, encoding == 'base64'
end

-- The body of a payload (nil when none is found) and whether it is base64.
local function bodyOf(payload)
  if string.sub(payload, 1, #COMPACT_START) == COMPACT_START then
    return compactBodyOf(payload)
  end
  return rawBodyOf(payload), base64Body(payload) ~= nil
end

local function textMatches(payload)
  local body, base64 = bodyOf(payload)
  if not body then return false end
  if not base64 then
    return string.find(body, wantText, 1, true) ~= nil
  end
  local n = #wantText
  for a = 0, 2 do
    local pattern, lead = ARGV[11 + a * 2], tonumber(ARGV[12 + a * 2])
    if pattern and pattern ~= '' then
      local pos = string.find(body, pattern, 1, true)
      while pos do
        local group = pos - lead  -- 1-based start of the 4-character group
        if group >= 1 and (group - 1) % 4 == 0 then
          local chars = math.ceil((a + n) / 3) * 4
          local bytes = decode(body, group, chars)
          if bytes and string.sub(bytes, a + 1, a + n) == wantText then
            return true
          end
        end
        pos = string.find(body, pattern, pos + 1, true)
      end
    end
  end
  return false
end

local function nameOf(meta, queue, payload)
  if type(meta.name) == 'string' and meta.name ~= '' then return meta.name end
  local task = string.match(payload, '"task": *"([^"]*)"')
  if task and task ~= '' then return task end
  return queue
end

local function errorMatches(meta)
  if meta.exc_type == wantError then return true end
  return type(meta.error) == 'string' and string.find(meta.error, wantError, 1, true) ~= nil
end

local matches, scanned = {}, 0
local lastScore, sameScore, lastId = start, offset, afterId
for i = 1, #entries, 2 do
  local id, score = entries[i], entries[i + 1]
  scanned = scanned + 1
  if score == lastScore then
    sameScore = sameScore + 1
  else
    lastScore, sameScore = score, 1
  end
  local rec = nil
  if afterId == '' or score ~= start or not passed(id) then
    lastId = id
    rec = redis.call('HGET', recordsKey, id)
  end
  if rec then
    local nl1 = string.find(rec, '\n', 1, true)
    local nl2 = nl1 and string.find(rec, '\n', nl1 + 1, true)
    if nl2 then
      local ok, meta = pcall(cjson.decode, string.sub(rec, 1, nl1 - 1))
      if not ok or type(meta) ~= 'table' then meta = {} end
      local queue = string.sub(rec, nl1 + 1, nl2 - 1)
      local payload = string.sub(rec, nl2 + 1)
      local keep = true
      if wantName ~= '' and nameOf(meta, queue, payload) ~= wantName then keep = false end
      if keep and wantError ~= '' and not errorMatches(meta) then keep = false end
      if keep and wantText ~= '' and not textMatches(payload) then keep = false end
      if keep then
        matches[#matches + 1] = id
        matches[#matches + 1] = score
        if #matches / 2 >= wantMatches then break end
      end
    end
  end
end
-- Done when this step read every entry it was given and the range had fewer than asked.
local done = 0
if scanned == #entries / 2 and #entries / 2 < chunk then done = 1 end
return {matches, lastScore, sameScore, scanned, done, lastId}
