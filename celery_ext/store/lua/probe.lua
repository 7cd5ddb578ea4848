-- probe: answer at once; sent on a fresh connection when a reply is overdue
-- (store/probe.py). A script, not PING: whatever holds the plugin's scripts back
-- (CLIENT PAUSE WRITE, a long script: BUSY) holds this one back too, so a probe
-- answered means the server is running scripts now and the silent connection is dead.
-- (no KEYS, no ARGV)
-- Returns 1.
return 1
