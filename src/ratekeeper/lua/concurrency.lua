-- concurrency.lua: in-flight leases. At most `limit` units of cost held at once per identity;
-- a lease expires `window` after it was taken, so a crashed holder cannot leak capacity.
--
-- KEYS[1]  a sorted set; member = lease token .. '.' .. unit index, score = expiry (us)
-- ARGV     the shared layout (see ratekeeper/_algorithms/_base.py):
--          now (0 = server TIME), cost, mode, token, TTL margin (ms), n = 1, limit, lease timeout
--          in microseconds. mode 0 = acquire cost units as lease `token`, 1 = peek,
--          2 = release lease `token` (its cost units)
--
-- Returns {ok, remaining, reset, retry}: ok = 1 when acquired (mode 0), when cost units are free
-- (mode 1) or when the lease was still held (mode 2); remaining = free units after the call;
-- reset = us until every lease now held has expired; retry = us until cost units free up by
-- expiry alone (-1 = free now, -2 = never). A denial writes nothing.
-- now, cost, mode, peek, n, key and idiv come from _prelude.lua.

local token = ARGV[4]
local limit = tonumber(ARGV[7])
local timeout = tonumber(ARGV[8])
local live = string.format('(%d', now)

if mode == '2' then
  local members = {}
  for j = 1, cost do members[#members + 1] = token .. '.' .. j end
  local held = redis.call('ZMSCORE', key, unpack(members))
  local ok = 0
  for j = 1, cost do
    if held[j] and tonumber(held[j]) > now then ok = 1 end
  end
  redis.call('ZREM', key, unpack(members))
  local count = redis.call('ZCOUNT', key, live, '+inf')
  local reset = 0
  local top = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if count > 0 then reset = tonumber(top[2]) - now end
  local remaining = limit - count
  if remaining < 0 then remaining = 0 end
  return {ok, remaining, reset, -1}
end

local count = redis.call('ZCOUNT', key, live, '+inf')
local top = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
local allowed = count + cost <= limit
local retry = -1
if cost > limit then
  retry = -2
elseif not allowed then
  local entry = redis.call('ZRANGEBYSCORE', key, live, '+inf', 'WITHSCORES', 'LIMIT',
    count + cost - limit - 1, 1)
  retry = tonumber(entry[2]) - now
end
local used = count
local last = nil
if count > 0 then last = tonumber(top[2]) end
if allowed and mode == '0' then
  used = count + cost
  local expiry = now + timeout
  if last == nil or expiry > last then last = expiry end
  local score = string.format('%d', expiry)
  local batch = {}
  for j = 1, cost do
    batch[#batch + 1] = score
    batch[#batch + 1] = token .. '.' .. j
  end
  redis.call('ZADD', key, unpack(batch))
  redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now))
  redis.call('PEXPIRE', key, string.format('%d', math.ceil((last - now) / 1000) + tonumber(ARGV[5])))
end
local reset = 0
if used > 0 then reset = last - now end
local remaining = limit - used
if remaining < 0 then remaining = 0 end
return {allowed and 1 or 0, remaining, reset, retry}
