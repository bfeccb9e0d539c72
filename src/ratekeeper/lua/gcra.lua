-- gcra.lua: the generic cell rate algorithm (a token bucket without a refill loop), all rates
-- all-or-nothing, in one hash. O(1) memory: one theoretical arrival time (TAT) per rate.
--
-- KEYS[1]  a hash; per rate i the fields 'q<i>' and 'r<i>': TAT = q + r / limit milliseconds
--          since the epoch, exact (the emission interval W / limit is a fraction of a ms)
-- ARGV     the shared layout (see ratekeeper/_algorithms/_base.py):
--          now (0 = server TIME), cost, mode (0 hit, else read only), token (unused), TTL margin (ms),
--          n, then n pairs of limit and window in microseconds, then n bursts
--
-- With emission interval T = W / limit and burst B, a cost c fits at time t when
--     max(TAT, t) + c * T - t <= B * T,
-- and admitting it sets TAT = max(TAT, t) + c * T. Computed on d = (TAT - t) * limit, an integer
-- below 2^53 (the policy checks B * W_ms <= 2^52), so Lua and Python agree exactly.
-- Time is in whole milliseconds: t = floor(now / 1000).
--
-- Returns {allowed, remaining_1, reset_1, retry_1, ...}; times in microseconds; retry -1 = fits,
-- -2 = never (cost above the burst). A denial writes nothing.
-- now, cost, mode, peek, n, key and idiv come from _prelude.lua.

local tms = idiv(now, 1000)
local fields = {}
for i = 1, n do
  fields[#fields + 1] = 'q' .. i
  fields[#fields + 1] = 'r' .. i
end
local stored = redis.call('HMGET', key, unpack(fields))

local allowed = true
local ds = {}
for i = 1, n do
  local limit = tonumber(ARGV[5 + 2 * i])
  local wms = tonumber(ARGV[6 + 2 * i]) / 1000
  local burst = tonumber(ARGV[6 + 2 * n + i])
  local q, r = tonumber(stored[2 * i - 1]), tonumber(stored[2 * i])
  local d = 0
  if q and q >= tms then d = (q - tms) * limit + r end
  ds[i] = d
  if d + cost * wms > burst * wms then allowed = false end
end
local consume = allowed and not peek

local reply = {allowed and 1 or 0}
local ttl = 0
local writes = {}
for i = 1, n do
  local limit = tonumber(ARGV[5 + 2 * i])
  local wms = tonumber(ARGV[6 + 2 * i]) / 1000
  local burst = tonumber(ARGV[6 + 2 * n + i])
  local d = ds[i]
  local after = d
  if consume then after = d + cost * wms end
  local remaining = idiv(burst * wms - after, wms)
  if remaining < 0 then remaining = 0 end
  -- Microseconds until TAT: (after / limit) ms from tms, rounded up.
  local whole = idiv(after, limit)
  local reset = tms * 1000 - now + whole * 1000 + idiv((after - whole * limit) * 1000 + limit - 1, limit)
  if after == 0 or reset < 0 then reset = 0 end
  local retry = -1
  if cost > burst then
    retry = -2
  elseif d + cost * wms > burst * wms then
    retry = (tms + idiv(d + cost * wms - burst * wms + limit - 1, limit)) * 1000 - now
  end
  reply[#reply + 1] = remaining
  reply[#reply + 1] = reset
  reply[#reply + 1] = retry
  if reset > ttl then ttl = reset end
  writes[#writes + 1] = 'q' .. i
  writes[#writes + 1] = string.format('%d', tms + whole)
  writes[#writes + 1] = 'r' .. i
  writes[#writes + 1] = string.format('%d', after - whole * limit)
end

if consume then
  redis.call('HSET', key, unpack(writes))
  redis.call('PEXPIRE', key, string.format('%d', math.ceil(ttl / 1000) + tonumber(ARGV[5])))
end
return reply
