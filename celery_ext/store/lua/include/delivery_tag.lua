-- _delivery_tag: a stored job's delivery tag, the name of its in-flight record and of its
-- recovery count in {ns}:redelivery (a line "-- @include delivery_tag", see scripts.py).
-- Kombu writes "properties" last, with "delivery_tag" after its other properties, and our
-- producers add only "enqueued_at" (and "fair_key") after it (a republished message, e.g.
-- by celery migrate, may add delivery_mode/priority): the tag is looked for in the last
-- TAG_WINDOW bytes only, the last occurrence winning, so the cost does not grow with the
-- payload. A job whose tag is not there (another client's layout) gets
-- "untagged-<sha1 of its length, first and last 512 bytes>": the same on every read.
local TAG_WINDOW = 1024

-- The message's own delivery tag, from the end of the payload only: the last occurrence
-- in its last `window` bytes, or nil.
local function tag_in(payload, window)
  local tag, from = nil, math.max(1, #payload - window + 1)
  while true do
    local _, e = string.find(payload, '"delivery_tag": "', from, true)
    if not e then return tag end
    local q = string.find(payload, '"', e + 1, true)
    if not q then return tag end
    tag = string.sub(payload, e + 1, q - 1)
    from = q + 1
  end
end

-- The delivery tag of a stored payload (never nil; see above).
local function tag_of(payload)
  -- Our producers' tag ends about 60 bytes before the end: look there first.
  local tag = tag_in(payload, 128) or tag_in(payload, TAG_WINDOW)
  if not tag or tag == '' then
    tag = 'untagged-' .. redis.sha1hex(#payload .. '\n' .. string.sub(payload, 1, 512)
                                       .. '\n' .. string.sub(payload, -512))
  end
  return tag
end
