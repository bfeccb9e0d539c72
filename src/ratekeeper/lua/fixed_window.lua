-- fixed_window.lua: a counter per aligned window, all rates all-or-nothing, in one hash.
--
-- KEYS[1]  a hash; per rate i the fields 'w<i>' (start of the counted window, us since the
--          epoch) and 'c<i>' (units counted in it)
-- ARGV     the shared layout (see ratekeeper/_algorithms/_base.py):
--          now (0 = server TIME), cost, mode (0 hit, else read only), token (unused), TTL margin (ms),
--          n, then n pairs of limit and window in microseconds
--
-- Windows are aligned to the epoch: [floor(now / W) * W, +W). A count from an older window is
-- worth nothing. The TTL is set to the end of the longest current window plus a margin, never
-- now + W, so hits cannot keep a key alive past its window.
--
-- Returns {allowed, remaining_1, reset_1, retry_1, ...}; times in microseconds; retry -1 = fits,
-- -2 = never (cost above the limit). A denial writes nothing.
-- now, cost, mode, peek, n, key and idiv come from _prelude.lua.

local fields = {}
for i = 1, n do
  fields[#fields + 1] = 'w' .. i
  fields[#fields + 1] = 'c' .. i
end
local stored = redis.call('HMGET', key, unpack(fields))

local allowed = true
local counts, starts = {}, {}
for i = 1, n do
  local limit = tonumber(ARGV[5 + 2 * i])
  local window = tonumber(ARGV[6 + 2 * i])
  local start = now - (now % window)
  local count = 0
  if tonumber(stored[2 * i - 1]) == start then count = tonumber(stored[2 * i]) end
  starts[i] = start
  counts[i] = count
  if count + cost > limit then allowed = false end
end
local consume = allowed and not peek

local reply = {allowed and 1 or 0}
local expire_at = 0
local writes = {}
for i = 1, n do
  local limit = tonumber(ARGV[5 + 2 * i])
  local window = tonumber(ARGV[6 + 2 * i])
  local used = counts[i]
  if consume then used = used + cost end
  local remaining = limit - used
  if remaining < 0 then remaining = 0 end
  local ends = starts[i] + window
  local reset = 0
  if used > 0 then reset = ends - now end
  local retry = -1
  if counts[i] + cost > limit then
    if cost > limit then retry = -2 else retry = ends - now end
  end
  reply[#reply + 1] = remaining
  reply[#reply + 1] = reset
  reply[#reply + 1] = retry
  if ends > expire_at then expire_at = ends end
  writes[#writes + 1] = 'w' .. i
  writes[#writes + 1] = string.format('%d', starts[i])
  writes[#writes + 1] = 'c' .. i
  writes[#writes + 1] = string.format('%d', used)
end

if consume then
  redis.call('HSET', key, unpack(writes))
  local ttl = math.ceil((expire_at - now) / 1000) + tonumber(ARGV[5])
  redis.call('PEXPIRE', key, string.format('%d', ttl))
end
return reply
