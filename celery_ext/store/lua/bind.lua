#!lua flags=allow-oom
-- bind: record a Kombu queue binding even when Redis is at maxmemory. A binding is one
-- small set member; without it a worker cannot start, and a full Redis is exactly
-- when workers must start and drain it (instead of exiting in a restart loop).
-- KEYS[1]  binding table               _kombu.binding.<exchange>
-- KEYS[2]  permanent bindings set      _kombu.binding_permanent.<exchange>, or (when
--                                      ARGV[3] > 0) the binding deadlines zset
-- ARGV[1]  member                      "<routing key>\x06\x16<pattern>\x06\x16<queue>"
-- ARGV[2]  exchange name
-- ARGV[3]  binding TTL in ms, 0 for a queue without x-expires
-- Same writes as Kombu's own (pipeline SADD x2, or its refresh-binding script).
-- @include clock
redis.call('SADD', KEYS[1], ARGV[1])
local ttl = tonumber(ARGV[3])
if ttl > 0 then
  local ms = clock_ms()
  redis.call('ZADD', KEYS[2], 'GT', ms + ttl, ARGV[2])
else
  redis.call('SADD', KEYS[2], ARGV[1])
end
return 1
