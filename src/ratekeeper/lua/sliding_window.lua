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
-- policy checks limit * W_ms <= 2^53), in milliseconds, so Lua and Python agree exactly:
-- a cost fits when prev * (W - e) <= (limit - curr - c) * W.
--
-- Returns {allowed, remaining_1, reset_1, retry_1, ...}; times in microseconds; retry -1 = fits,
-- -2 = never. A denial writes nothing.
-- now, cost, mode, peek, n, key and idiv come from _prelude.lua.

local fields = {}
for i = 1, n do
  fields[#fields + 1] = 'w' .. i
  fields[#fields + 1] = 'c' .. i
  fields[#fields + 1] = 'p' .. i
end
local stored = redis.call('HMGET', key, unpack(fields))

local allowed = true
local starts, currs, prevs = {}, {}, {}
for i = 1, n do
  local limit = tonumber(ARGV[5 + 2 * i])
  local window = tonumber(ARGV[6 + 2 * i])
  local start = now - (now % window)
  local w = tonumber(stored[3 * i - 2])
  local curr, prev = 0, 0
  if w == start then
    curr, prev = tonumber(stored[3 * i - 1]), tonumber(stored[3 * i])
  elseif w == start - window then
    prev = tonumber(stored[3 * i - 1])
  end
  starts[i], currs[i], prevs[i] = start, curr, prev
  local wms = window / 1000
  local e = idiv(now - start, 1000)
  if prev * (wms - e) > (limit - curr - cost) * wms then allowed = false end
end
local consume = allowed and not peek

local reply = {allowed and 1 or 0}
local expire_at = 0
local writes = {}
for i = 1, n do
  local limit = tonumber(ARGV[5 + 2 * i])
  local window = tonumber(ARGV[6 + 2 * i])
  local wms = window / 1000
  local start, curr, prev = starts[i], currs[i], prevs[i]
  local e = idiv(now - start, 1000)
  if consume then curr = curr + cost end
  -- remaining = floor(limit - curr - prev * (W - e) / W)
  local remaining = limit - curr - idiv(prev * (wms - e) + wms - 1, wms)
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
  elseif prev * (wms - e) > (limit - currs[i] - cost) * wms then
    if currs[i] + cost <= limit then
      -- Later in this window: prev * (W - e') <= (limit - curr - cost) * W.
      local at = wms - idiv((limit - currs[i] - cost) * wms, prev)
      retry = start + at * 1000 - now
    else
      -- In the next window, where the current count becomes the previous one.
      local at = wms - idiv((limit - cost) * wms, currs[i])
      retry = start + window + at * 1000 - now
    end
  end
  reply[#reply + 1] = remaining
  reply[#reply + 1] = reset
  reply[#reply + 1] = retry
  if start + 2 * window > expire_at then expire_at = start + 2 * window end
  writes[#writes + 1] = 'w' .. i
  writes[#writes + 1] = string.format('%d', start)
  writes[#writes + 1] = 'c' .. i
  writes[#writes + 1] = string.format('%d', curr)
  writes[#writes + 1] = 'p' .. i
  writes[#writes + 1] = string.format('%d', prev)
end

if consume then
  redis.call('HSET', key, unpack(writes))
  local ttl = math.ceil((expire_at - now) / 1000) + tonumber(ARGV[5])
  redis.call('PEXPIRE', key, string.format('%d', ttl))
end
return reply
