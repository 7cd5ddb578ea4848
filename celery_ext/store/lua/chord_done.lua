-- chord_done: the chord's body was published, or the chord failed; it counts no more.
-- KEYS[1]  chord        {ns:<group id>}:chord          hash: size, counted, claimed_by, state
-- KEYS[2]  counted ids  {ns:<group id>}:chord_ids      set of "<task id>:<header index>"
-- KEYS[3]  results      {ns:<group id>}:chord_results  zset: header result -> header index
-- ARGV[1]  "sent" or "failed"
-- ARGV[2]  why it failed ("" when sent)
-- ARGV[3]  seconds the chord's record lives on (what operators and late duplicates read)
-- The counted ids and results are dropped (the body has them, or nobody needs them); the
-- chord's hash stays with its state until it expires, so a late duplicate of a header job
-- finds the chord settled and does nothing. Returns 1.
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], 'state', ARGV[1])
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], 'error', ARGV[2])
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
