-- _prelude.lua: prepended to every script by ratekeeper/_scripts.py (Lua scripts cannot import).
-- It reads the ARGV layout all scripts share (see ratekeeper/_algorithms/_base.py):
--   now (us; 0 = the server's TIME), cost, mode (0 hit, 1 peek, 2 release), token, margin (ms),
--   n, then n pairs of limit and window (us), then the algorithm's own arguments.

local now = tonumber(ARGV[1])
if now <= 0 then
  -- Redis 6.2 needs effects replication before a non-deterministic command; 7+ always does it,
  -- and there the call, a no-op, still costs a fifth of a script's time.
  if not redis.REDIS_VERSION_NUM and redis.replicate_commands then redis.replicate_commands() end
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local cost = tonumber(ARGV[2])
local mode = ARGV[3]
local peek = mode ~= '0'
local n = tonumber(ARGV[6])
local key = KEYS[1]

-- floor(a / b) for integers, exact where a / b in doubles might round across an integer.
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end

