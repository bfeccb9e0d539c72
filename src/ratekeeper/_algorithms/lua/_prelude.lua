-- _prelude.lua: prepended to every script by ratekeeper/_scripts.py (Lua scripts cannot import).
-- It reads what every script needs of the ARGV layout (see ratekeeper/_algorithms/_base.py):
--   now (us; 0 = the server's TIME), cost, mode (0 hit, 1 peek, 2 release, 3 reserve, 4 charge,
--   5 refund), token, margin (ms),
--   n, then n pairs of limit and window (us), then the algorithm's own arguments.
--
-- Every step of a script counts (see benchmarks/script_cost.py): a redis.call costs about as much
-- as returning the reply table, and parsing or printing a number, or growing a table, a fifth
-- to a third of that. So the scripts call Redis only when the answer can change the reply, read
-- each argument once, as s + 0 (tonumber parses a string twice), build tables at their final
-- size where they can, and send numbers to Redis as strings made by string.format('%d'): Redis
-- 7.0 would print a Lua number with the slower '%.17g', and tostring or '..' use '%.14g', which
-- writes times in microseconds in scientific notation. Helpers that two scripts share (the
-- n-th newest log entry, writing pairs of hash fields) are written out in each instead of here:
-- a function defined in the prelude is built again on every call of every script, which cost
-- the counters 9-15% more server time when measured.

local now = ARGV[1] + 0
-- With the server's clock, a key's TTL and its windows run on one clock: a TTL set at a
-- window's end stays right for the whole window. A client's clock may not keep pace with it.
local server_clock = now <= 0
if server_clock then
  -- Redis 6.2 needs effects replication before a non-deterministic command; 7+ always does it,
  -- and there the call, a no-op, still costs a fifth of a script's time.
  if not redis.REDIS_VERSION_NUM and redis.replicate_commands then redis.replicate_commands() end
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
end
local cost = ARGV[2] + 0
local mode = ARGV[3]
-- Read only: anything but a hit or a reserve (a charge or a refund writes first, then peeks).
local peek = mode ~= '0' and mode ~= '3'
local n = ARGV[6] + 0
local key = KEYS[1]
