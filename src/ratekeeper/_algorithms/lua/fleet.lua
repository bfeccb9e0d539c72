-- fleet.lua: one heartbeat of a limiter with local_share="auto"; returns the live fleet count.
--
-- KEYS[1]  a sorted set: instance id -> the time (us since the epoch) its membership expires
-- ARGV     the shared layout (see ratekeeper/_algorithms/_base.py) with no rates:
--          now (0 = server TIME), cost (unused), mode (unused), token = this instance's id,
--          TTL margin (ms), n = 0, then the membership TTL in microseconds
--
-- Stamps the id with now + ttl, drops every member whose expiry is at or before now, and sets
-- the key's TTL to the longest membership left plus the margin, so a fleet that stops leaves
-- nothing.
-- The write comes first, so an OOM rejects the script before it changes anything.
--
-- Returns {count}: the members left, this one included.
--
-- Python reference: ratekeeper/_algorithms/fleet.py, which the memory backend runs;
-- tests/test_fleet.py demands the same replies and the same members from both. No deliberate
-- differences.
-- now and key come from _prelude.lua.

local ttl = ARGV[7] + 0
redis.call('ZADD', key, string.format('%d', now + ttl), ARGV[4])
redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now))
local count = redis.call('ZCARD', key)
-- The key lives as long as its longest membership (instances may run with different TTLs).
local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2] + 0
redis.call('PEXPIRE', key, string.format('%d', math.ceil((last - now) / 1000) + ARGV[5]))
return {count}
