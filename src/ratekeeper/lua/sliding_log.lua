-- sliding_log.lua: exact sliding-window log over one sorted set, all rates all-or-nothing.
--
-- KEYS[1]  the log: a sorted set; score = admission time in microseconds, member = unique token
-- ARGV[1]  now, microseconds since the epoch; 0 = use the server clock (TIME)
-- ARGV[2]  cost, an integer >= 1
-- ARGV[3]  mode: 0 = hit (consume when every rate admits), anything else = read only
-- ARGV[4]  token, unique per call; the members written are token .. '.' .. i for i = 1..cost
-- ARGV[5]  margin in milliseconds: the log lives its longest window plus this (clock skew)
-- ARGV[6]  n, the number of rates; then for i = 1..n: ARGV[5+2i] limit, ARGV[6+2i] window (us)
--
-- Returns {allowed, remaining_1, reset_1, retry_1, ..., remaining_n, reset_n, retry_n}:
--   allowed      1 if every rate admits the cost (and, in hit mode, it was consumed), else 0
--   remaining_i  units left in rate i's window after this call
--   reset_i      microseconds until rate i's window is empty again
--   retry_i      microseconds until a call of this cost fits rate i; -1 = it fits, -2 = never
--
-- A denial writes nothing. All reads happen before the first write, so an out-of-memory
-- error on the first write leaves no partial state. Numbers sent back to Redis go through
-- string.format('%d'): tostring would print large times in scientific notation.
-- now, cost, mode, peek, n, key and idiv come from _prelude.lua.

local newest = nil
local top = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
if top[2] then newest = tonumber(top[2]) end

local allowed = true
local counts = {}
local maxwindow = 0
for i = 1, n do
  local limit = tonumber(ARGV[5 + 2 * i])
  local window = tonumber(ARGV[6 + 2 * i])
  if window > maxwindow then maxwindow = window end
  local count = redis.call('ZCOUNT', key, string.format('(%d', now - window), '+inf')
  counts[i] = count
  if count + cost > limit then allowed = false end
end
local consume = allowed and not peek

local reply = {allowed and 1 or 0}
for i = 1, n do
  local limit = tonumber(ARGV[5 + 2 * i])
  local window = tonumber(ARGV[6 + 2 * i])
  local count = counts[i]
  local used = count
  if consume then used = count + cost end
  local remaining = limit - used
  if remaining < 0 then remaining = 0 end
  local retry = -1
  if count + cost > limit then
    if cost > limit then
      retry = -2
    else
      -- The oldest (count + cost - limit) entries in the window must leave first.
      local entry = redis.call('ZRANGEBYSCORE', key, string.format('(%d', now - window), '+inf',
        'WITHSCORES', 'LIMIT', count + cost - limit - 1, 1)
      retry = tonumber(entry[2]) + window - now
    end
  end
  local last = newest
  if consume and (last == nil or now > last) then last = now end
  local reset = 0
  if last ~= nil and used > 0 then
    reset = last + window - now
    if reset < 0 then reset = 0 end
  end
  reply[#reply + 1] = remaining
  reply[#reply + 1] = reset
  reply[#reply + 1] = retry
end

if consume then
  local score = string.format('%d', now)
  local token = ARGV[4]
  local i = 1
  while i <= cost do
    local batch = {}
    local last = math.min(i + 199, cost)
    for j = i, last do
      batch[#batch + 1] = score
      batch[#batch + 1] = token .. '.' .. j
    end
    redis.call('ZADD', key, unpack(batch))
    i = last + 1
  end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now - maxwindow))
  redis.call('PEXPIRE', key, string.format('%d', math.ceil(maxwindow / 1000) + tonumber(ARGV[5])))
end
return reply
