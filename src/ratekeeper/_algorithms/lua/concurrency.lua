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
--
-- Cost: every call reads the newest READ members. When that is the whole set (few leases held)
-- it answers everything: no count, no pruning unless a lease has expired, and a release finds
-- its members there. Otherwise the units held are counted (ZCOUNT) when every member read is
-- live, and a release looks its members' scores up (ZMSCORE).
-- Live leases (expiry > now) are the newest members, so the lease a denial waits for is the
-- (limit - cost)-th newest, 0-based.
--
-- Python reference: ratekeeper/_algorithms/concurrency.py (its _Leases is a sorted set in
-- miniature), which the memory backend runs; tests/test_property.py demands the same reply and
-- the same leases stored from both. The deliberate differences (each also in the reference's
-- docstring) change neither:
--   * The read shortcut above: the reference counts by bisection, looks its members up by
--     name and prunes expired leases on every acquire; here ZCOUNT, ZMSCORE, the rank lookups
--     and ZREMRANGEBYSCORE run only when the newest READ members cannot answer (a release
--     recognises its own members among them by name: token .. '.' .. unit, 1 <= unit <= cost).
--   * Emptying the set on release: ZREM of the last members deletes the key (Redis keeps no
--     empty sorted set); the reference deletes its key explicitly when no member is left.
--     Neither sets a TTL on release.
-- now, cost, mode, n and key come from _prelude.lua.

local READ, FROM = 3, '-3'  -- the newest READ members: ranks FROM to -1
local token = ARGV[4]
local limit = ARGV[7] + 0
local got = redis.call('ZRANGE', key, FROM, '-1', 'WITHSCORES')
local m = #got / 2
local whole = m < READ
for j = 2, 2 * m, 2 do got[j] = got[j] + 0 end
-- got[2j] > now for j > expired: the leases read that are still held.
local expired = m
while expired > 0 and got[2 * expired] > now do expired = expired - 1 end
-- The units held: exact unless every member read is live and there are more.
local count = m - expired
if expired == 0 and not whole then
  count = redis.call('ZCOUNT', key, string.format('%d', now + 1), '+inf')
end

if mode == '2' then
  -- This lease's members: token.1 .. token.cost. Among those read (ours[j]), or looked up.
  local prefix = token .. '.'
  local ours = {}
  for j = 1, m do
    local member = got[2 * j - 1]
    if string.sub(member, 1, #prefix) == prefix then
      local unit = tonumber(string.sub(member, #prefix + 1))
      ours[j] = unit and unit >= 1 and unit <= cost and unit % 1 == 0 and member == prefix .. unit
    end
  end
  local ok, gone, members = 0, 0, {}
  if whole then
    for j = 1, m do
      if ours[j] then
        members[#members + 1] = got[2 * j - 1]
        if got[2 * j] > now then ok, gone = 1, gone + 1 end
      end
    end
  else
    for j = 1, cost do members[j] = prefix .. j end
    local held = redis.call('ZMSCORE', key, unpack(members))
    for j = 1, cost do
      if held[j] and held[j] + 0 > now then ok, gone = 1, gone + 1 end
    end
  end
  if #members > 0 then redis.call('ZREM', key, unpack(members)) end
  count = count - gone
  -- The newest lease left, if any is held: the newest read that is not ours, else look.
  local reset = 0
  if count > 0 then
    local j = m
    while j > 0 and ours[j] do j = j - 1 end
    local last
    if j > 0 then
      last = got[2 * j]
    else
      last = redis.call('ZRANGE', key, '-1', '-1', 'WITHSCORES')[2] + 0
    end
    reset = last - now
  end
  local remaining = limit - count
  if remaining < 0 then remaining = 0 end
  return {ok, remaining, reset, -1}
end

local allowed = count + cost <= limit
local retry = -1
if cost > limit then
  retry = -2
elseif not allowed then
  -- The (limit - cost)-th newest lease (0-based) must expire first.
  local r = limit - cost
  local at
  if r < m then
    at = got[2 * (m - r)]
  else
    local rank = string.format('%d', -r - 1)
    at = redis.call('ZRANGE', key, rank, rank, 'WITHSCORES')[2] + 0
  end
  retry = at - now
end
local used = count
local last = nil
if count > 0 then last = got[2 * m] end
if allowed and mode == '0' then
  used = count + cost
  local expiry = now + ARGV[8]
  if last == nil or expiry > last then last = expiry end
  local score = string.format('%d', expiry)
  if cost == 1 then
    redis.call('ZADD', key, score, token .. '.1')
  else
    local batch = {}
    for j = 1, cost do batch[2 * j - 1], batch[2 * j] = score, token .. '.' .. j end
    redis.call('ZADD', key, unpack(batch))
  end
  -- Expired leases go; there are none when the whole set was read and every lease is live.
  if not whole or expired > 0 then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now))
  end
  redis.call('PEXPIRE', key, string.format('%d', math.ceil((last - now) / 1000) + ARGV[5]))
end
local reset = 0
if used > 0 then reset = last - now end
local remaining = limit - used
if remaining < 0 then remaining = 0 end
return {allowed and 1 or 0, remaining, reset, retry}
