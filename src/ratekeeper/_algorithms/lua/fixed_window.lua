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
-- now + W, so hits cannot keep a key alive past its window. On the server's clock, a hit that
-- starts no new window leaves the TTL as it is.
--
-- Returns {allowed, remaining_1, reset_1, retry_1, ...}; times in microseconds; retry -1 = fits,
-- -2 = never (cost above the limit). A denial writes nothing.
--
-- Python reference: ratekeeper/_algorithms/fixed_window.py, which the memory backend runs;
-- tests/test_property.py demands the same reply and the same stored fields from both. The
-- deliberate differences (each also in the reference's docstring) change neither:
--   * The TTL skip: on the server's clock, an admission in the windows already stored writes
--     only the counts (HSET c<i>) and no PEXPIRE; the TTL set when those windows were stored
--     ends with the longest of them. The reference writes every field and sets the TTL on
--     every admission, to the same end within the TTL's 1 ms rounding. On a client's clock the
--     script does so too: the server's clock, which runs the TTL, may not keep pace with it.
--   * Only this policy's fields are read (HMGET); the reference reads the whole hash. Both
--     leave fields of other rates in the hash as they are.
-- Settling a reservation (mode 4 charges cost in the current windows, past the limit, up to
-- 2^52 a window; mode 5 refunds cost from each rate whose current window is the one the
-- reservation at ARGV[4] was counted in) writes first, then replies as a peek of cost 1.
-- now, server_clock, cost, mode, peek, n and key come from _prelude.lua.

if mode == '4' or mode == '5' then
  local fields = {}
  for i = 1, n do fields[2 * i - 1], fields[2 * i] = 'w' .. i, 'c' .. i end
  local got = redis.call('HMGET', key, unpack(fields))
  local at = 0
  if mode == '5' then at = ARGV[4] + 0 end
  local writes, ttl, changed = {}, 0, false
  for i = 1, n do
    local window = ARGV[6 + 2 * i] + 0
    local start = now - now % window
    local count = 0
    if got[2 * i - 1] and got[2 * i - 1] + 0 == start then count = got[2 * i] + 0 end
    if cost > 0 then
      if mode == '4' then
        count, changed = math.min(count + cost, 4503599627370496), true
      elseif at - at % window == start then
        count, changed = math.max(count - cost, 0), true
      end
    end
    writes[4 * i - 3], writes[4 * i - 2] = 'w' .. i, string.format('%d', start)
    writes[4 * i - 1], writes[4 * i] = 'c' .. i, string.format('%d', count)
    if start + window - now > ttl then ttl = start + window - now end
  end
  if changed then
    redis.call('HSET', key, unpack(writes))
    redis.call('PEXPIRE', key, string.format('%d', math.ceil(ttl / 1000) + ARGV[5]))
  end
  cost = 1
end

local stored
if n == 1 then
  stored = redis.call('HMGET', key, 'w1', 'c1')
else
  local fields = {}
  for i = 1, n do fields[2 * i - 1], fields[2 * i] = 'w' .. i, 'c' .. i end
  stored = redis.call('HMGET', key, unpack(fields))
end

-- Per rate i, rates[4i - 3 .. 4i] = limit, window, start of the current window, count in it.
local rates = {0, 0, 0, 0}
local allowed = true
local same = true  -- whether every rate is still in its stored window
for i = 1, n do
  local limit, window = ARGV[5 + 2 * i] + 0, ARGV[6 + 2 * i] + 0
  local start = now - now % window
  local count = 0
  if stored[2 * i - 1] and stored[2 * i - 1] + 0 == start then
    count = stored[2 * i] + 0
  else
    same = false
  end
  rates[4 * i - 3], rates[4 * i - 2], rates[4 * i - 1], rates[4 * i] = limit, window, start, count
  if count + cost > limit then allowed = false end
end
local consume = allowed and not peek

local reply = {allowed and 1 or 0, 0, 0, 0}
local ttl = 0
for i = 1, n do
  local limit, start, count = rates[4 * i - 3], rates[4 * i - 1], rates[4 * i]
  local left = start + rates[4 * i - 2] - now
  local used = count
  if consume then used = count + cost end
  local remaining, reset, retry = limit - used, 0, -1
  if remaining < 0 then remaining = 0 end
  if used > 0 then reset = left end
  if count + cost > limit then
    if cost > limit then retry = -2 else retry = left end
  end
  reply[3 * i - 1], reply[3 * i], reply[3 * i + 1] = remaining, reset, retry
  if left > ttl then ttl = left end
  rates[4 * i] = used
end

if consume and same and server_clock then
  -- Every rate is in its stored window: only the counts change. The TTL set when those windows
  -- were stored already ends with the longest of them.
  if n == 1 then
    redis.call('HSET', key, 'c1', string.format('%d', rates[4]))
  else
    local writes = {}
    for i = 1, n do writes[2 * i - 1], writes[2 * i] = 'c' .. i, string.format('%d', rates[4 * i]) end
    redis.call('HSET', key, unpack(writes))
  end
elseif consume then
  if n == 1 then
    local start, used = string.format('%d', rates[3]), string.format('%d', rates[4])
    redis.call('HSET', key, 'w1', start, 'c1', used)
  else
    local writes = {}
    for i = 1, n do
      writes[4 * i - 3], writes[4 * i - 2] = 'w' .. i, string.format('%d', rates[4 * i - 1])
      writes[4 * i - 1], writes[4 * i] = 'c' .. i, string.format('%d', rates[4 * i])
    end
    redis.call('HSET', key, unpack(writes))
  end
  redis.call('PEXPIRE', key, string.format('%d', math.ceil(ttl / 1000) + ARGV[5]))
end
if consume and mode == '3' then reply[3 * n + 2] = now end  -- a reservation's stamp
return reply
