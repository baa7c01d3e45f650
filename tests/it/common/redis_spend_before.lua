-- The spend scripts of the Redis layout before the reservation was slimmed (commit 8dffa48):
-- what a proxy of the previous version runs against a Redis it shares with this one.
-- helpers
local function keys_of(prefix, c)
  return prefix .. c .. ':win', prefix .. c .. ':tot', prefix .. c .. ':amt', prefix .. c .. ':kept'
end
local function age(prefix, c, since, now, keep)
  local win, tot, amt, kept = keys_of(prefix, c)
  local gone = redis.call('ZRANGEBYSCORE', win, '-inf', since)
  if #gone > 0 then
    local sum = 0
    for _, m in ipairs(gone) do sum = sum + tonumber(redis.call('HGET', amt, m) or '0') end
    redis.call('DECRBY', tot, sum)
    redis.call('ZREMRANGEBYSCORE', win, '-inf', since)
  end
  local old = redis.call('ZRANGEBYSCORE', kept, '-inf', now - keep)
  if #old > 0 then
    for _, m in ipairs(old) do redis.call('HDEL', amt, m) end
    redis.call('ZREMRANGEBYSCORE', kept, '-inf', now - keep)
  end
end
local function within(prefix, c, token)
  local win, _, amt = keys_of(prefix, c)
  if redis.call('ZSCORE', win, token) then
    return tonumber(redis.call('HGET', amt, token) or '0')
  end
  return 0
end
local function release(prefix, token)
  local res = prefix .. 'res:' .. token
  local on = redis.call('HKEYS', res)
  for _, c in ipairs(on) do
    local win, tot, amt, kept = keys_of(prefix, c)
    local back = within(prefix, c, token)
    if back ~= 0 then redis.call('DECRBY', tot, back) end
    redis.call('ZREM', win, token)
    redis.call('HDEL', amt, token)
    redis.call('ZREM', kept, token)
  end
  redis.call('DEL', res)
end
-- @@ reserve
local prefix, token, now, keep = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local enforce, replaces, n = ARGV[5] == '1', ARGV[6], tonumber(ARGV[7])
if redis.call('EXISTS', KEYS[1]) == 1 then return {'existing', 0, 0} end
local fat = 4 * n + 9 + 2 * tonumber(ARGV[4 * n + 8])
for k = 1, tonumber(ARGV[fat]) do
  if redis.call('HEXISTS', prefix .. 'freezes', ARGV[fat + k]) == 1 then
    return {'frozen', k - 1, 0}
  end
end
local names, caps, adds, sums = {}, {}, {}, {}
for i = 1, n do
  local a = 4 * i + 4
  names[i], caps[i], adds[i] = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 3])
  age(prefix, names[i], tonumber(ARGV[a + 2]), now, keep)
  local _, tot = keys_of(prefix, names[i])
  sums[i] = tonumber(redis.call('GET', tot) or '0')
  if replaces ~= '' then sums[i] = sums[i] - within(prefix, names[i], replaces) end
end
local verdict, vi, vs = 'added', 0, 0
for i = 1, n do
  if caps[i] ~= '' and sums[i] + adds[i] > tonumber(caps[i]) then
    verdict, vi, vs = 'over', i - 1, sums[i]
    break
  end
end
if verdict == 'added' then
  local m = tonumber(ARGV[4 * n + 8])
  for j = 1, m do
    local idx = tonumber(ARGV[4 * n + 7 + 2 * j]) + 1
    if sums[idx] + adds[idx] > tonumber(ARGV[4 * n + 8 + 2 * j]) then
      verdict, vi, vs = 'approval', idx - 1, sums[idx]
      break
    end
  end
end
if verdict ~= 'added' and enforce then return {verdict, vi, vs} end
if replaces ~= '' then release(prefix, replaces) end
for i = 1, n do
  local win, tot, amt, kept = keys_of(prefix, names[i])
  redis.call('INCRBY', tot, adds[i])
  redis.call('ZADD', win, now, token)
  redis.call('HSET', amt, token, adds[i])
  redis.call('ZADD', kept, now, token)
  redis.call('HSET', KEYS[1], names[i], adds[i])
  for _, k in ipairs({win, tot, amt, kept}) do redis.call('PEXPIRE', k, keep) end
end
redis.call('PEXPIRE', KEYS[1], keep)
return {verdict, vi, vs}
-- @@ release
release(ARGV[1], ARGV[2])
return 1
