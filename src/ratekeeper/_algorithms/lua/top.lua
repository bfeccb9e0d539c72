-- top.lua: the store's side of the top offenders (ratekeeper/_top.py): merge one limiter's
-- summary into a policy's minute, or read the top identities of some minutes.
--
-- ARGV     the shared layout (see ratekeeper/_algorithms/_base.py) with no rates: now (the
--          client's, unused), cost (unused), mode, token (unused), TTL margin (ms), n = 0,
--          then, by mode:
--   mode 0 (merge)  KEYS[1] a sorted set identity -> denials, KEYS[2] the minute's total
--                   ARGV[7] the keys' TTL (ms), ARGV[8] the most members kept, ARGV[9] the
--                   denials to add to the total, then identity, count pairs.
--                   Adds the counts and the total, drops the members past the most kept
--                   (the lowest counts: each at most total / kept, the error bound the
--                   readers state), and sets both TTLs. Returns {members}.
--   mode 1 (read)   KEYS: sorted set, total, sorted set, total, ... (the minutes asked)
--                   ARGV[7] the most identities returned.
--                   Returns {total, identity, count, identity, count, ...}: the minutes'
--                   counts summed per identity, highest first (ties by identity).
--
-- All the keys of one policy share its hash tag, so one call reads or writes them together.
-- The writes come first, so an OOM rejects the merge before it changes anything.
--
-- Python reference: ratekeeper/_algorithms/top.py, which the memory backend runs;
-- tests/test_top.py demands the same replies from both. No deliberate differences.

if mode == '0' then
  local ttl = ARGV[7]
  local kept = ARGV[8] + 0
  redis.call('INCRBY', KEYS[2], ARGV[9])
  for i = 10, #ARGV, 2 do
    redis.call('ZINCRBY', key, ARGV[i + 1], ARGV[i])
  end
  local members = redis.call('ZCARD', key)
  if members > kept then
    redis.call('ZREMRANGEBYRANK', key, 0, members - kept - 1)
    members = kept
  end
  redis.call('PEXPIRE', key, ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
  return {members}
end

local most = ARGV[7] + 0
local total = 0
local sums = {}
local names = {}
for i = 1, #KEYS, 2 do
  local pairs_ = redis.call('ZRANGE', KEYS[i], 0, -1, 'WITHSCORES')
  for j = 1, #pairs_, 2 do
    local member = pairs_[j]
    local count = sums[member]
    if count == nil then
      names[#names + 1] = member
      count = 0
    end
    sums[member] = count + pairs_[j + 1]
  end
  total = total + (tonumber(redis.call('GET', KEYS[i + 1])) or 0)
end
table.sort(names, function(a, b)
  local x, y = sums[a], sums[b]
  if x ~= y then return x > y end
  return a < b
end)
local reply = {total}
for i = 1, math.min(most, #names) do
  reply[#reply + 1] = names[i]
  reply[#reply + 1] = sums[names[i]]
end
return reply
