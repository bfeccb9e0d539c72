-- sliding_log.lua: exact sliding-window log over one Redis list, all rates all-or-nothing.
--
-- KEYS[1]  the log: a list of admission times in microseconds, one element per admitted unit,
--          oldest at the head (index 0), newest at the tail (index -1)
-- ARGV[1]  now, microseconds since the epoch; 0 = use the server clock (TIME)
-- ARGV[2]  cost, an integer >= 1
-- ARGV[3]  mode: 0 = hit (consume when every rate admits), anything else = read only
-- ARGV[4]  token: unused (a list needs no unique members)
-- ARGV[5]  margin in milliseconds: the log lives until its newest entry has left the longest
--          window, plus this (clock skew)
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
-- Time order. The list must stay sorted by time, so an admission appends its entries at
-- max(now, the newest entry): when a client's clock goes back (the server's TIME can too), the
-- new entries take the newest time already stored. Such an entry leaves every window later than
-- one stamped now would, so the clamp can only make a wait longer, never admit more; the key's
-- TTL runs from the newest entry too, so it never expires before that entry leaves its window.
-- A list element is a 64-bit integer in a listpack: about 10 bytes an entry, against 86-129
-- for a sorted-set member, and no unique member to build (the seed's collision cannot occur).
--
-- Cost: every call reads the newest READ entries. When that is the whole log (a light user)
-- it answers everything. Otherwise a window whose oldest entry read is inside it is counted
-- by searching the list by index (LINDEX, O(log n) calls): the longest window gallops from
-- the head (indexes 0, 1, 3, 7, ..., then bisects), where an admission left no entry outside
-- it, so a full log is counted with one LINDEX 0 and a log one entry past it with two. A
-- shorter window needs only its newest limit + 1 entries (a count that reaches limit + 1 gives
-- the same reply as any larger one): with a limit up to SMALL it reads them in one LRANGE,
-- else it bisects them (measured with callgrind: one LRANGE is cheaper at a limit of 5,
-- bisecting at 50). The entry a denial waits for is the (limit - cost)-th newest, 0-based: the
-- oldest of those that must leave first, usually read already. An admission appends, then
-- trims what left the longest window (LTRIM keeps the newest: those of that window, and the
-- ones appended), only when there is such an entry.
--
-- Python reference: ratekeeper/_algorithms/sliding_log.py, which the memory backend runs;
-- tests/test_property.py demands the same reply and the same stored times from both. The
-- deliberate difference (also in the reference's docstring) changes neither: here the newest
-- READ entries answer when they can, the rest of the list is searched only when they cannot,
-- and a shorter window's count stops at limit + 1; the reference bisects every window.
--
-- Settling a reservation writes first, then replies as a peek of cost 1. A refund (mode 5)
-- removes cost entries of the reservation's time, ARGV[4] (those still in the log: entries of
-- one time are alike, and the ones that left every window count no more). A charge (mode 4)
-- appends min(cost, the largest limit) entries at max(now, the newest entry), past the limit:
-- that many entries of one time fill every window until they leave, so more would change no
-- reply, whatever is refunded later (a refund takes back at most what was admitted, which
-- never exceeded the limit).
-- now, cost, mode, peek, n and key come from _prelude.lua.

if mode == '5' and cost > 0 then
  redis.call('LREM', key, string.format('%d', cost), ARGV[4])
elseif mode == '4' and cost > 0 then
  local most, maxwindow = 0, 0
  for i = 1, n do
    local limit, window = ARGV[5 + 2 * i] + 0, ARGV[6 + 2 * i] + 0
    if limit > most then most = limit end
    if window > maxwindow then maxwindow = window end
  end
  local newest = redis.call('LINDEX', key, '-1')
  local stamp = now
  if newest and newest + 0 > now then stamp = newest + 0 end
  local at = string.format('%d', stamp)
  local batch = {}
  for j = 1, math.min(cost, most, 1000) do batch[j] = at end
  local left = math.min(cost, most)
  while left > 0 do
    local k = math.min(left, 1000)
    redis.call('RPUSH', key, unpack(batch, 1, k))
    left = left - k
  end
  redis.call('PEXPIRE', key, string.format('%d', math.ceil((stamp - now + maxwindow) / 1000) + ARGV[5]))
end
if mode == '4' or mode == '5' then cost = 1 end

local READ, FROM = 2, '-2'  -- the newest READ entries: indexes FROM to -1
local got = redis.call('LRANGE', key, FROM, '-1')
local m = #got
local whole = m < READ
for j = 1, m do got[j] = got[j] + 0 end
local first = got[1]  -- the oldest entry read
local len = nil  -- the log's length (LLEN), read only when a window needs a search
local seen = nil  -- index -> time, of the entries LINDEX read (made when a search starts)
local waits = nil  -- rate -> the time of the entry its denial waits for, when read by LRANGE
local SMALL = 10  -- a shorter window with a limit up to this reads its newest limit + 1 at once

-- Per rate i, rates[3i - 2 .. 3i] = limit, window, and the count of entries in the window.
local rates = {0, 0, 0}
local maxwindow = 0
for i = 1, n do
  local window = ARGV[6 + 2 * i] + 0
  rates[3 * i - 2], rates[3 * i - 1] = ARGV[5 + 2 * i] + 0, window
  if window > maxwindow then maxwindow = window end
end
local allowed = true
-- Of the longest window: its count, and whether an entry has left it (an admission trims).
local maxcount, stale = 0, false
for i = 1, n do
  local limit, window = rates[3 * i - 2], rates[3 * i - 1]
  -- The window holds the entries with time > now - window (times are whole microseconds).
  local edge = now - window
  local count, out  -- out: how many entries have left this window (are older than it)
  if whole or first <= edge then
    local j = m
    while j > 0 and got[j] > edge do j = j - 1 end
    count, out = m - j, j
  elseif window < maxwindow and limit <= SMALL then
    -- A shorter window with a small limit: its newest limit + 1 entries answer it (a count
    -- that reaches limit + 1 gives the same reply as any larger one).
    local more = redis.call('LRANGE', key, string.format('%d', -limit - 1), '-1')
    local k = #more
    local j = k
    while j > 0 and more[j] + 0 > edge do j = j - 1 end
    count, out = k - j, 0
    local r = limit - cost
    if count + cost > limit and r >= 0 then
      if waits == nil then waits = {} end
      waits[i] = more[k - r] + 0
    end
  else
    -- The READ newest are inside: the first entry inside is at an index in [lo, hi].
    if len == nil then len, seen = redis.call('LLEN', key), {} end
    local lo, hi = 0, len - m
    -- The longest window gallops (gaps 0, 1, 3, 7, ...) from the head until the first entry
    -- inside is bracketed, then bisects (gap = -1). A shorter window bisects the newest
    -- limit + 1 entries, once the oldest of them is outside (else the count reaches limit + 1,
    -- which gives the same reply as any larger count).
    local longest, gap = window == maxwindow, 0
    if not longest then
      gap = -1
      local p = len - limit - 1
      if p >= 0 and p < hi then
        local t = seen[p]
        if t == nil then
          t = redis.call('LINDEX', key, string.format('%d', p)) + 0
          seen[p] = t
        end
        if t > edge then lo, hi = p, p else lo = p + 1 end
      end
    end
    while lo < hi do
      local p
      if gap >= 0 then
        p = lo + gap
        if p >= hi then
          gap, p = -1, math.floor((lo + hi) / 2)
        else
          gap = 2 * gap + 1
        end
      else
        p = math.floor((lo + hi) / 2)
      end
      local t = seen[p]
      if t == nil then
        t = redis.call('LINDEX', key, string.format('%d', p)) + 0
        seen[p] = t
      end
      if t > edge then
        hi, gap = p, -1
      else
        lo = p + 1
      end
    end
    count, out = len - lo, lo
  end
  rates[3 * i] = count
  if window == maxwindow then maxcount, stale = count, out > 0 end
  if count + cost > limit then allowed = false end
end
local consume = allowed and not peek

-- The newest entry; when this call adds entries, the time they take (never older than it).
local last = got[m]
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
      local at = nil
      if waits ~= nil then at = waits[i] end
      if at ~= nil then  -- read with the window's newest entries
      elseif r < m then
        at = got[m - r]
      else
        if len ~= nil then at = seen[len - 1 - r] end
        if at == nil then at = redis.call('LINDEX', key, string.format('%d', -r - 1)) + 0 end
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
  local at = string.format('%d', last)
  if cost == 1 then
    redis.call('RPUSH', key, at)
  else
    local batch = {}
    for j = 1, math.min(cost, 1000) do batch[j] = at end
    local left = cost
    while left > 0 do
      local k = math.min(left, 1000)
      redis.call('RPUSH', key, unpack(batch, 1, k))
      left = left - k
    end
  end
  -- Entries at or before now - maxwindow have left every window: keep only the newer ones.
  if stale then redis.call('LTRIM', key, string.format('%d', -(maxcount + cost)), '-1') end
  -- The log lives until its newest entry has left the longest window, plus the margin.
  local ttl = math.ceil((last - now + maxwindow) / 1000) + ARGV[5]
  redis.call('PEXPIRE', key, string.format('%d', ttl))
  if mode == '3' then reply[3 * n + 2] = last end  -- a reservation's stamp: its entries' time
end
return reply
