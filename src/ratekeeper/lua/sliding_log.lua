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
-- error on the first write leaves no partial state.
--
-- Cost: every call reads the newest READ entries. When that is the whole log (a light user)
-- it answers everything: no count of the window, and no pruning unless an entry has aged out.
-- Otherwise a rate is counted (ZCOUNT) when both entries read are inside its window, and each
-- admission prunes. The entry a denial waits for is the (limit - cost)-th newest, 0-based: the
-- oldest of those that must leave first.
--
-- Python reference: ratekeeper/_algorithms/sliding_log.py, which the memory backend runs;
-- tests/test_property.py demands the same reply and the same stored times from both. The
-- deliberate differences (each also in the reference's docstring) change neither:
--   * The reference keeps a list of times and ignores the token. Here each admitted unit is a
--     member token .. '.' .. i, so equal times stay distinct entries; that is why the token
--     must be unique per call (a reused one would move existing members, not add entries).
--   * The read shortcut above: the reference counts each window by bisection and prunes on
--     every admission; here ZCOUNT, the rank lookup and ZREMRANGEBYSCORE run only when the
--     newest READ entries cannot answer.
-- now, cost, peek, n and key come from _prelude.lua.

local READ, FROM = 2, '-2'  -- the newest READ entries: ranks FROM to -1
local got = redis.call('ZRANGE', key, FROM, '-1', 'WITHSCORES')
local m = #got / 2
local whole = m < READ
for j = 2, 2 * m, 2 do got[j] = got[j] + 0 end

-- Per rate i, rates[3i - 2 .. 3i] = limit, window, and the count of entries in the window.
local rates = {0, 0, 0}
local allowed = true
local maxwindow = 0
for i = 1, n do
  local limit, window = ARGV[5 + 2 * i] + 0, ARGV[6 + 2 * i] + 0
  if window > maxwindow then maxwindow = window end
  -- The window holds the entries with time > now - window (times are whole microseconds).
  local edge = now - window
  local j = m
  while j > 0 and got[2 * j] > edge do j = j - 1 end
  local count = m - j
  if j == 0 and not whole then
    count = redis.call('ZCOUNT', key, string.format('%d', edge + 1), '+inf')
  end
  rates[3 * i - 2], rates[3 * i - 1], rates[3 * i] = limit, window, count
  if count + cost > limit then allowed = false end
end
local consume = allowed and not peek

-- The newest entry, or now when this call adds a newer one.
local last = got[2 * m]
if consume and (last == nil or now > last) then last = now end
local reply = {allowed and 1 or 0, 0, 0, 0}
for i = 1, n do
  local limit, window, count = rates[3 * i - 2], rates[3 * i - 1], rates[3 * i]
  local used = count
  if consume then used = count + cost end
  local remaining = limit - used
  if remaining < 0 then remaining = 0 end
  local retry = -1
  if count + cost > limit then
    if cost > limit then
      retry = -2
    else
      -- The (limit - cost)-th newest entry (0-based) must leave the window first.
      local r = limit - cost
      local at
      if r < m then
        at = got[2 * (m - r)]
      else
        local rank = string.format('%d', -r - 1)
        at = redis.call('ZRANGE', key, rank, rank, 'WITHSCORES')[2] + 0
      end
      retry = at + window - now
    end
  end
  local reset = 0
  if last ~= nil and used > 0 then
    reset = last + window - now
    if reset < 0 then reset = 0 end
  end
  reply[3 * i - 1], reply[3 * i], reply[3 * i + 1] = remaining, reset, retry
end

if consume then
  local score, token = string.format('%d', now), ARGV[4]
  if cost == 1 then
    redis.call('ZADD', key, score, token .. '.1')
  else
    local i = 1
    while i <= cost do
      local batch = {}
      local upto = math.min(i + 199, cost)
      for j = i, upto do
        batch[2 * (j - i) + 1] = score
        batch[2 * (j - i) + 2] = token .. '.' .. j
      end
      redis.call('ZADD', key, unpack(batch))
      i = upto + 1
    end
  end
  -- Entries at or before now - maxwindow have left every window: drop them, unless the whole
  -- log was read and its oldest entry is newer.
  if not whole or (m > 0 and got[2] <= now - maxwindow) then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now - maxwindow))
  end
  redis.call('PEXPIRE', key, string.format('%d', math.ceil(maxwindow / 1000) + ARGV[5]))
end
return reply
