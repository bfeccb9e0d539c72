-- sliding_window.lua: the sliding window counter (Cloudflare's estimate), all rates
-- all-or-nothing, in one hash. O(1) memory per identity and rate.
--
-- KEYS[1]  a hash; per rate i the fields 'w<i>' (start of the current window, us since the
--          epoch), 'c<i>' (units counted in it) and 'p<i>' (units counted in the window before)
-- ARGV     the shared layout (see ratekeeper/_algorithms/_base.py):
--          now (0 = server TIME), cost, mode (0 hit, else read only), token (unused), TTL margin (ms),
--          n, then n pairs of limit and window in microseconds
--
-- The estimate at elapsed time e (ms) into the current window of W ms is
--     used = prev * (W - e) / W + curr
-- and a cost c fits when used + c <= limit. All arithmetic is on integers below 2^53 (the
-- policy checks limit * W_ms <= 2^52, so twice the limit fits too), in milliseconds, so Lua and Python agree exactly:
-- a cost fits when prev * (W - e) <= (limit - curr - c) * W.
--
-- Returns {allowed, remaining_1, reset_1, retry_1, ...}; times in microseconds; retry -1 = fits,
-- -2 = never. A denial writes nothing.
--
-- Python reference: ratekeeper/_algorithms/sliding_window.py, which the memory backend runs;
-- tests/test_property.py demands the same reply and the same stored fields from both. The
-- deliberate differences (each also in the reference's docstring) change neither:
--   * The TTL skip: on the server's clock, an admission in the windows already stored writes
--     only the current counts (HSET c<i>) and no PEXPIRE; the TTL set when those windows were
--     stored runs to the end of the longest window after them. The reference writes every
--     field (w, c and p, the same values) and sets the TTL on every admission, to the same end
--     within the TTL's 1 ms rounding. On a client's clock the script writes all and sets the
--     TTL too: the server's clock, which runs the TTL, may not keep pace with the client's.
--   * Only this policy's fields are read (HMGET); the reference reads the whole hash.
--   * W in ms is window / 1000 here (a double) and window // 1000 there: the same, because a
--     window is always a whole number of milliseconds (Rate.period_us).
--
-- Settling a reservation (mode 4 charges cost in the current window, past the limit, up to
-- floor(2^53 / W_ms) - limit, where every product stays exact; mode 5 refunds cost from the
-- window the reservation at ARGV[4] was counted in, the current or the previous one) writes
-- first, then replies as a peek of cost 1.
-- now, server_clock, cost, mode, peek, n and key come from _prelude.lua.

-- floor(a / b) for integers, exact where a / b in doubles might round across an integer.
local function idiv(a, b)
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end

if mode == '4' or mode == '5' then
  local fields = {}
  for i = 1, n do
    fields[3 * i - 2], fields[3 * i - 1], fields[3 * i] = 'w' .. i, 'c' .. i, 'p' .. i
  end
  local got = redis.call('HMGET', key, unpack(fields))
  local at = 0
  if mode == '5' then at = ARGV[4] + 0 end
  local writes, expire_at, changed = {}, 0, false
  for i = 1, n do
    local limit, window = ARGV[5 + 2 * i] + 0, ARGV[6 + 2 * i] + 0
    local start = now - (now % window)
    local w = got[3 * i - 2]
    if w then w = w + 0 end
    local curr, prev = 0, 0
    if w == start then
      curr, prev = got[3 * i - 1] + 0, got[3 * i] + 0
    elseif w == start - window then
      prev = got[3 * i - 1] + 0
    end
    if cost > 0 then
      local from = at - at % window
      if mode == '4' then
        -- floor(2^53 / W_ms), exactly: half of it, doubled, plus what the halves' remainders add.
        local wms = window / 1000
        local half = idiv(4503599627370496, wms)
        local most = 2 * half - limit
        if 2 * (4503599627370496 - half * wms) >= wms then most = most + 1 end
        curr, changed = math.min(curr + cost, most), true
      elseif from == start then
        curr, changed = math.max(curr - cost, 0), true
      elseif from == start - window then
        prev, changed = math.max(prev - cost, 0), true
      end
    end
    local k = 6 * i
    writes[k - 5], writes[k - 4] = 'w' .. i, string.format('%d', start)
    writes[k - 3], writes[k - 2] = 'c' .. i, string.format('%d', curr)
    writes[k - 1], writes[k] = 'p' .. i, string.format('%d', prev)
    if start + 2 * window > expire_at then expire_at = start + 2 * window end
  end
  if changed then
    redis.call('HSET', key, unpack(writes))
    local ttl = math.ceil((expire_at - now) / 1000) + ARGV[5]
    redis.call('PEXPIRE', key, string.format('%d', ttl))
  end
  cost = 1
end

local stored
if n == 1 then
  stored = redis.call('HMGET', key, 'w1', 'c1', 'p1')
else
  local fields = {}
  for i = 1, n do
    fields[3 * i - 2], fields[3 * i - 1], fields[3 * i] = 'w' .. i, 'c' .. i, 'p' .. i
  end
  stored = redis.call('HMGET', key, unpack(fields))
end

-- Per rate i, rates[6i - 5 .. 6i] = limit, window, start of the current window, curr, prev, and
-- e, the whole milliseconds elapsed in the window.
local rates = {0, 0, 0, 0, 0, 0}
local allowed = true
local same = true  -- whether every rate is still in the stored window
for i = 1, n do
  local limit, window = ARGV[5 + 2 * i] + 0, ARGV[6 + 2 * i] + 0
  local start = now - (now % window)
  local w = stored[3 * i - 2]
  if w then w = w + 0 end
  local curr, prev = 0, 0
  if w == start then
    curr, prev = stored[3 * i - 1] + 0, stored[3 * i] + 0
  else
    same = false
    if w == start - window then prev = stored[3 * i - 1] + 0 end
  end
  local wms, e = window / 1000, idiv(now - start, 1000)
  local k = 6 * i
  rates[k - 5], rates[k - 4], rates[k - 3], rates[k - 2], rates[k - 1], rates[k] =
    limit, window, start, curr, prev, e
  if prev * (wms - e) > (limit - curr - cost) * wms then allowed = false end
end
local consume = allowed and not peek

local reply = {allowed and 1 or 0, 0, 0, 0}
local expire_at = 0
for i = 1, n do
  local k = 6 * i
  local limit, window, start, curr0, prev, e =
    rates[k - 5], rates[k - 4], rates[k - 3], rates[k - 2], rates[k - 1], rates[k]
  local wms = window / 1000
  local curr = curr0
  if consume then curr = curr0 + cost end
  -- remaining = floor(limit - curr - prev * (W - e) / W)
  local remaining = limit - curr
  if prev > 0 then remaining = remaining - idiv(prev * (wms - e) + wms - 1, wms) end
  if remaining < 0 then remaining = 0 end
  local reset = 0
  if curr > 0 then
    reset = start + 2 * window - now
  elseif prev > 0 then
    reset = start + window - now
  end
  local retry = -1
  if cost > limit then
    retry = -2
  elseif prev * (wms - e) > (limit - curr0 - cost) * wms then
    if curr0 + cost <= limit then
      -- Later in this window: prev * (W - e') <= (limit - curr - cost) * W.
      retry = start + (wms - idiv((limit - curr0 - cost) * wms, prev)) * 1000 - now
    else
      -- In the next window, where the current count becomes the previous one.
      retry = start + window + (wms - idiv((limit - cost) * wms, curr0)) * 1000 - now
    end
  end
  reply[3 * i - 1], reply[3 * i], reply[3 * i + 1] = remaining, reset, retry
  if start + 2 * window > expire_at then expire_at = start + 2 * window end
  rates[k - 2] = curr
end

if consume then
  if same and server_clock then
    -- Every rate is in its stored window: only the current counts change. The TTL set when
    -- those windows were stored already runs to the end of the longest window after them.
    if n == 1 then
      redis.call('HSET', key, 'c1', string.format('%d', rates[4]))
    else
      local writes = {}
      for i = 1, n do
        writes[2 * i - 1], writes[2 * i] = 'c' .. i, string.format('%d', rates[6 * i - 2])
      end
      redis.call('HSET', key, unpack(writes))
    end
  else
    if n == 1 then
      local start, curr = string.format('%d', rates[3]), string.format('%d', rates[4])
      redis.call('HSET', key, 'w1', start, 'c1', curr, 'p1', string.format('%d', rates[5]))
    else
      local writes = {}
      for i = 1, n do
        local k = 6 * i
        writes[k - 5], writes[k - 4] = 'w' .. i, string.format('%d', rates[k - 3])
        writes[k - 3], writes[k - 2] = 'c' .. i, string.format('%d', rates[k - 2])
        writes[k - 1], writes[k] = 'p' .. i, string.format('%d', rates[k - 1])
      end
      redis.call('HSET', key, unpack(writes))
    end
    local ttl = math.ceil((expire_at - now) / 1000) + ARGV[5]
    redis.call('PEXPIRE', key, string.format('%d', ttl))
  end
end
if consume and mode == '3' then reply[3 * n + 2] = now end  -- a reservation's stamp
return reply
