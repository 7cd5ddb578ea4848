#!lua flags=allow-oom
-- declare: many job queues declared in one call at a worker's start (transport/queues.py,
-- JobQueues.predeclared): the size of each queue given in KEYS, as Kombu's queue_declare
-- reads it (only queues whose count a callback reads are given: a key per priority level
-- of 10,000 queues was 40,000 keys for counts nobody read), and every queue's binding
-- written to Kombu's binding tables, as Kombu's queue_bind writes it (two SADD).
-- With 10,000 job names a pipeline of those commands carried 60,000 of them and read
-- 60,000 replies; this reads one. One node and Sentinel only: on a cluster the queues'
-- lists are in many slots, and the channel declares through a pipeline
-- (transport/topology/base.py). At maxmemory the bindings are written anyway (as
-- bind.lua does): a worker must start and drain a full Redis.
-- KEYS[1 .. n*L]  job queue lists, L per queue, one per priority level
--                 {ns}:queue:<name> (and its level lists), queue by queue
-- KEYS[n*L+1 ..]  two per exchange: its binding table _kombu.binding.<exchange> and its
--                 permanent bindings set _kombu.binding_permanent.<exchange>
-- ARGV[1]  L, the lists per queue
-- ARGV[2]  n, the number of queues
-- ARGV[3 ..] per exchange, in the order of its pair of KEYS: m, the number of its
--          members, then its m members "<routing key>\x06\x16<pattern>\x06\x16<queue>"
-- Returns the n sizes, each the sum of the queue's L list lengths, in queue order.
local nlev, n = tonumber(ARGV[1]), tonumber(ARGV[2])
local sizes = {}
for q = 0, n - 1 do
  local size = 0
  for j = 1, nlev do
    size = size + redis.call('LLEN', KEYS[q * nlev + j])
  end
  sizes[q + 1] = size
end
local key, arg = n * nlev + 1, 3
while key < #KEYS do
  local m = tonumber(ARGV[arg])
  for i = arg + 1, arg + m do
    redis.call('SADD', KEYS[key], ARGV[i])
    redis.call('SADD', KEYS[key + 1], ARGV[i])
  end
  key, arg = key + 2, arg + m + 1
end
return sizes
