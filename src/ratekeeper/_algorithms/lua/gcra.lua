-- gcra.lua: the generic cell rate algorithm (a token bucket without a refill loop), all rates
-- all-or-nothing, in one hash. O(1) memory: one theoretical arrival time (TAT) per rate.
--
-- KEYS[1]  a hash; per rate i the fields 'q<i>' and 'r<i>': TAT = q + r / limit milliseconds
--          since the epoch, exact (the emission interval W / limit is a fraction of a ms)
-- ARGV     the shared layout (see ratekeeper/_algorithms/_base.py):
--          now (0 = server TIME), cost, mode (0 hit, 3 reserve, 4 charge, 5 refund, else read
--          only), token (a refund's reservation stamp, else unused), TTL margin (ms),
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
--
-- Python reference: ratekeeper/_algorithms/gcra.py, which the memory backend runs;
-- tests/test_property.py demands the same reply and the same stored fields from both. The
-- deliberate differences (each also in the reference's docstring) change neither:
--   * No TTL skip: every admission moves the TAT, so both sides write q<i> and r<i> and set
--     the TTL (until the bucket is full again) every time, on any clock.
--   * Only this policy's fields are read (HMGET); the reference reads the whole hash.
--   * W in ms is ARGV / 1000 here (a double) and window // 1000 there: the same, because a
--     window is always a whole number of milliseconds (Rate.period_us).
--
-- Settling a reservation moves d and nothing else (mode 4: d + cost * W, past the burst, up to
-- a debt whose arithmetic stays exact and whose wait fits 2^51 us; mode 5: a refund takes back
-- only what still counts). It writes first, then replies as a peek of cost 1. A refund of c
-- units of the reservation stamped s (ARGV 4, in whole ms a = floor(s / 1000)) moves the TAT
-- back by the part of c emission intervals, counted from a, still ahead of t:
--     d = max(d - min(c * W, max((a - t) * limit + c * W, 0)), 0).
-- The reserved units were emitted from max(TAT then, a) >= a on, and everything admitted
-- since is stacked above them, so the TAT never drops below what it would be had the units
-- never been counted (when no call since had a clock ahead of t): once the bucket has drained
-- past them (the reservation's units have come back by themselves) nothing is refunded, and
-- at the reservation's own ms all of it is.
-- now, cost, mode, peek, n and key come from _prelude.lua.

-- floor(a / b) for integers, exact where a / b in doubles might round across an integer.
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end

local tms = idiv(now, 1000)
local stored
if n == 1 then
  stored = redis.call('HMGET', key, 'q1', 'r1')
else
  local fields = {}
  for i = 1, n do fields[2 * i - 1], fields[2 * i] = 'q' .. i, 'r' .. i end
  stored = redis.call('HMGET', key, unpack(fields))
end

if mode == '4' or mode == '5' then
  local writes, ttl, changed = {}, 0, false
  -- The refunded reservation's stamp in whole ms: its units were counted from then on.
  local at = 0
  if mode == '5' then at = idiv(ARGV[4] + 0, 1000) end
  for i = 1, n do
    local limit, wms = ARGV[5 + 2 * i] + 0, ARGV[6 + 2 * i] / 1000
    local burst = ARGV[6 + 2 * n + i] + 0
    local q = stored[2 * i - 1]
    local d = 0
    if q then
      q = q + 0
      if q >= tms then d = (q - tms) * limit + stored[2 * i] end
    end
    if cost > 0 and (mode == '4' or d > 0) then
      changed = true
      if mode == '4' then
        d = math.min(d + cost * wms, 9007199254740992 - burst * wms, limit * 2251799813685)
      else
        -- cost * T from the stamp on, less what of it has passed: (at + cost T - t) * limit
        local ahead = (at - tms) * limit + cost * wms
        if ahead > cost * wms then ahead = cost * wms end
        if ahead < 0 then ahead = 0 end
        d = math.max(d - ahead, 0)
      end
    end
    local whole = idiv(d, limit)
    local rest = d - whole * limit
    writes[4 * i - 3], writes[4 * i - 2] = 'q' .. i, string.format('%d', tms + whole)
    writes[4 * i - 1], writes[4 * i] = 'r' .. i, string.format('%d', rest)
    stored[2 * i - 1], stored[2 * i] = tms + whole, rest
    local reset = 0
    if d > 0 then reset = tms * 1000 - now + whole * 1000 + idiv(rest * 1000 + limit - 1, limit) end
    if reset > ttl then ttl = reset end
  end
  if changed then
    redis.call('HSET', key, unpack(writes))
    redis.call('PEXPIRE', key, string.format('%d', math.ceil(ttl / 1000) + ARGV[5]))
  end
  cost = 1
end

-- Per rate i, rates[4i - 3 .. 4i] = limit, W in ms, burst, and d = (TAT - t) * limit (0 when
-- the TAT has passed).
local rates = {0, 0, 0, 0}
local allowed = true
for i = 1, n do
  local limit, wms = ARGV[5 + 2 * i] + 0, ARGV[6 + 2 * i] / 1000
  local burst = ARGV[6 + 2 * n + i] + 0
  local q = stored[2 * i - 1]
  local d = 0
  if q then
    q = q + 0
    if q >= tms then d = (q - tms) * limit + stored[2 * i] end
  end
  rates[4 * i - 3], rates[4 * i - 2], rates[4 * i - 1], rates[4 * i] = limit, wms, burst, d
  if d + cost * wms > burst * wms then allowed = false end
end
local consume = allowed and not peek

local reply = {allowed and 1 or 0, 0, 0, 0}
local ttl = 0
for i = 1, n do
  local limit, wms, burst, d = rates[4 * i - 3], rates[4 * i - 2], rates[4 * i - 1], rates[4 * i]
  local after = d
  if consume then after = d + cost * wms end
  local remaining = idiv(burst * wms - after, wms)
  if remaining < 0 then remaining = 0 end
  -- Microseconds until TAT: (after / limit) ms from tms, rounded up.
  local whole = idiv(after, limit)
  local reset = 0
  if after > 0 then
    local rest = after - whole * limit
    reset = tms * 1000 - now + whole * 1000 + idiv(rest * 1000 + limit - 1, limit)
    if reset < 0 then reset = 0 end
  end
  local retry = -1
  if cost > burst then
    retry = -2
  elseif d + cost * wms > burst * wms then
    retry = (tms + idiv(d + cost * wms - burst * wms + limit - 1, limit)) * 1000 - now
  end
  reply[3 * i - 1], reply[3 * i], reply[3 * i + 1] = remaining, reset, retry
  if reset > ttl then ttl = reset end
  -- The new TAT: q = tms + whole ms and r = after - whole * limit.
  rates[4 * i - 1], rates[4 * i] = tms + whole, after - whole * limit
end

if consume then
  if n == 1 then
    local q, r = string.format('%d', rates[3]), string.format('%d', rates[4])
    redis.call('HSET', key, 'q1', q, 'r1', r)
  else
    local writes = {}
    for i = 1, n do
      writes[4 * i - 3], writes[4 * i - 2] = 'q' .. i, string.format('%d', rates[4 * i - 1])
      writes[4 * i - 1], writes[4 * i] = 'r' .. i, string.format('%d', rates[4 * i])
    end
    redis.call('HSET', key, unpack(writes))
  end
  redis.call('PEXPIRE', key, string.format('%d', math.ceil(ttl / 1000) + ARGV[5]))
end
if consume and mode == '3' then reply[3 * n + 2] = now end  -- a reservation's stamp
return reply
