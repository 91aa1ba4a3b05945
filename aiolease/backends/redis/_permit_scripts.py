"""The Redis backend's permit scripts (semaphores and read-write locks): one Lua script
per operation over the keys of :class:`~aiolease.backends.redis._keys.PermitKeys`.

The rules are ``docs/internals/semaphores.md``'s. Every script reads the server's
clock (``TIME``) and judges expiry by it: a permit's score in the holders' sorted set
and a queue entry's score in the waits' sorted set are ``TIME`` + ttl in
milliseconds. Each script first drops what has expired (``purge``). A release, or a
purge that dropped something, grants the queued requests whose turn came (from the
queue's head, those that fit: ``grant_next``), each with the name's next token and
its queue entry's expiry, and announces each grant on the name's permit channel
(``<owner>\\n<token>:<ms>``, the lock's hand-off format): the waiter's
:meth:`~RedisBackend.wait_permit_turn` keeps it, and its next attempt is answered
without a script. A release that nobody waits for, or that frees too little for
the queue's head, grants and publishes nothing.

Foreign values are refused as the lock scripts refuse them (an error starting with
:data:`~aiolease.backends.redis._scripts.FOREIGN`), never overwritten.
"""

from __future__ import annotations

from ._scripts import LEASE_FUNCTIONS, Script

__all__ = ["PERMIT_ACQUIRE", "PERMIT_READ", "PERMIT_RELEASE", "PERMIT_RENEW"]

_PERMITS = (
    LEASE_FUNCTIONS
    + r"""
-- KEYS (every permit script): held, info, queue, waits, state, token
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A call whose WRONGTYPE refusal means a foreign value under our key.
local function typed(key, what, ...)
  local r = redis.pcall(...)
  if type(r) == 'table' and r.err then
    if string.find(r.err, 'WRONGTYPE', 1, true) then
      foreign(key, 'holds no ' .. what .. ' of aiolease')
    end
    error(r)
  end
  return r
end

local function decode(k, raw)
  if not raw then foreign(k[2], 'lacks the entry of a permit it lists') end
  local ok, e = pcall(cjson.decode, raw)
  if not ok or type(e) ~= 'table' or type(e.w) ~= 'number' or type(e.t) ~= 'number'
      or type(e.i) ~= 'string' or type(e.m) ~= 'string' then
    foreign(k[2], 'holds an entry that is not an aiolease permit')
  end
  return e
end

local function info_of(k, owner)
  local raw = typed(k[2], 'permit hash', 'HGET', k[2], owner)
  if not raw then return nil end
  return decode(k, raw)
end

-- INCR of the counter ("0", which aiolease never writes, counts as unused).
local function next_token(key)
  local token = redis.pcall('INCR', key)
  if type(token) == 'table' or token < 1 then
    if type(token) ~= 'table' then redis.call('DECR', key) end  -- put it back
    foreign(key, 'is not an aiolease token counter (a positive integer)')
  end
  return token
end

-- The recorded limit (nil if none) and the weight the live permits hold.
local function state_of(k)
  local v = typed(k[5], 'permit state hash', 'HMGET', k[5], 'limit', 'used')
  if (v[1] and not is_count(v[1])) or (v[2] and v[2] ~= '0' and not is_count(v[2])) then
    foreign(k[5], 'is not an aiolease permit state (limit, used)')
  end
  return v[1] and tonumber(v[1]), tonumber(v[2] or '0')
end

local function add_used(k, weight)
  redis.call('HINCRBY', k[5], 'used', weight)
end

-- Take `weight` off the held weight; what is left, or nil if the state hash was gone
-- (evicted): the new hash that HINCRBY made is dropped again, for the next request to
-- rebuild from the live permits (a negative weight would read as foreign data).
local function sub_used(k, weight)
  local left = typed(k[5], 'permit state hash', 'HINCRBY', k[5], 'used', -weight)
  if left < 0 then
    redis.call('DEL', k[5])
    return nil
  end
  return left
end

-- `command` of key with every member of `list` (unpack has a stack limit: in chunks);
-- the replies, concatenated.
local function each(key, what, command, list)
  local out = {}
  for i = 1, #list, 1000 do
    local part = typed(key, what, command, key, unpack(list, i, math.min(i + 999, #list)))
    if type(part) == 'table' then
      for _, v in ipairs(part) do out[#out + 1] = v end
    end
  end
  return out
end

-- The info entries of `owners`, in order, decoded.
local function infos(k, owners)
  local out = {}
  for i = 1, #owners, 1000 do
    local part = typed(k[2], 'permit hash', 'HMGET', k[2],
                       unpack(owners, i, math.min(i + 999, #owners)))
    for j = 1, #part do out[#out + 1] = decode(k, part[j]) end
  end
  return out
end

-- Drop the expired permits and queue entries; whether any was dropped.
local function purge(k, now)
  local expired = typed(k[1], 'permits sorted set', 'ZRANGEBYSCORE', k[1], '-inf', now)
  local lapsed = typed(k[4], 'permit waits sorted set', 'ZRANGEBYSCORE', k[4], '-inf', now)
  if #expired > 0 then
    local freed = 0
    for _, e in ipairs(infos(k, expired)) do freed = freed + e.w end
    redis.call('ZREMRANGEBYSCORE', k[1], '-inf', now)
    each(k[2], 'permit hash', 'HDEL', expired)
    sub_used(k, freed)
  end
  if #lapsed > 0 then
    redis.call('ZREMRANGEBYSCORE', k[4], '-inf', now)
    each(k[3], 'permit queue', 'ZREM', lapsed)
    each(k[2], 'permit hash', 'HDEL', lapsed)
  end
  return #expired + #lapsed > 0
end

-- Grant the requests whose turn came: from the queue's head, each entry that fits in
-- what the live permits leave, with those before it (first come, first served: none
-- after one that does not fit), takes the name's next token and becomes a permit that
-- lasts what was left of its queue entry (a waiter that is gone loses it then; one
-- that gave up releases it), and is announced on `channel`:
-- "<owner>\n<token>:<ms it lasts>" (the waiter takes its grant from the message:
-- see _permit_ops). The waiters behind hear of grants to others only.
local function grant_next(k, channel)
  local limit, used = state_of(k)
  if not limit then  -- the state was lost: every waiter asks (an acquire rebuilds it)
    redis.call('PUBLISH', channel, '')
    return
  end
  local now = now_ms()
  while true do  -- in chunks: most releases grant one waiter of a long queue
    local part = typed(k[3], 'permit queue', 'ZRANGE', k[3], 0, 15)
    if #part == 0 then return end
    local entries = infos(k, part)
    for j = 1, #part do
      local owner, e = part[j], entries[j]
      if used + e.w > limit then return end
      local expiry = tonumber(typed(k[4], 'permit waits sorted set', 'ZSCORE', k[4], owner))
      if not expiry or expiry <= now then  -- no expiry of its own: let it ask
        redis.call('PUBLISH', channel, owner)
        return
      end
      used = used + e.w
      e.t = next_token(k[6])
      redis.call('ZREM', k[3], owner)
      redis.call('ZREM', k[4], owner)
      redis.call('HSET', k[2], owner, cjson.encode(e))
      redis.call('ZADD', k[1], expiry, owner)
      add_used(k, e.w)
      redis.call('PUBLISH', channel, owner .. '\n' .. e.t .. ':' .. (expiry - now))
    end
  end
end

-- After a change: with nothing left, the keys go (not the token counter); else, if
-- `changed`, grant the requests whose turn came (grant_next); keys written last `ttl` at
-- least. `queued` and `held` are the queue's and the holders' sizes when the caller
-- knows them (else nil: counted here); `fresh`, that the state hash was just written
-- (it has no expiry yet: `ttl` is the longest).
local function settle(k, channel, changed, ttl, queued, held, fresh)
  queued = queued or redis.call('ZCARD', k[3])
  if changed and queued > 0 then grant_next(k, channel) end
  if queued == 0 and (held or redis.call('ZCARD', k[1])) == 0 then
    redis.call('DEL', k[1], k[2], k[3], k[4], k[5])
    return
  end
  if ttl then
    local keep = fresh and ttl or math.max(redis.call('PTTL', k[5]), ttl)
    -- An empty queue has no keys (its entries and their expiries go together).
    for i = 1, queued > 0 and 5 or 2 do redis.call('PEXPIRE', k[i], keep) end
    if queued == 0 then redis.call('PEXPIRE', k[5], keep) end
  end
end
"""
)

PERMIT_ACQUIRE = Script(
    "permit_acquire",
    _PERMITS
    + r"""
-- ARGV: owner, ttl ms, identity, metadata, limit, weight, channel
-- Reply: {1, token} granted; {0, owner, identity, token, metadata, pttl, last} refused
-- (and queued), who blocks, and the name's last token (a grant announced later with a
-- greater one came after this attempt); {3, held limit} another limit is held.
local k = KEYS
local owner, ttl, identity, metadata = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local limit, weight, channel = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
local now = now_ms()
local changed = purge(k, now)
local held_limit, used = state_of(k)
-- `fresh`: the state hash is written by this script (no expiry yet), with the weight
-- held once the request is judged (a grant's included: no HINCRBY); `holders`, that
-- some permit may be live (else no ZSCORE of the owner's).
local fresh, holders = false, true
if not held_limit or (redis.call('ZCARD', k[1]) == 0 and redis.call('ZCARD', k[3]) == 0) then
  -- nothing live (or the state evicted): this request sets the limit
  if held_limit then used, holders = 0, false else  -- evicted: what the live permits hold
    local owners = redis.call('ZRANGE', k[1], 0, -1)
    local total = 0
    for _, e in ipairs(infos(k, owners)) do total = total + e.w end
    used, holders = total, #owners > 0
  end
  fresh = true
elseif held_limit ~= limit then
  settle(k, channel, changed, nil)
  return {3, held_limit or 0}
end
local function write_state(weight)  -- (its only fields)
  if fresh then redis.call('HSET', k[5], 'limit', limit, 'used', used + weight)
  elseif weight > 0 then add_used(k, weight) end
end
if holders and redis.call('ZSCORE', k[1], owner) then
  -- a retry by the holder: its grant, its expiry reset
  write_state(0)
  local e = decode(k, typed(k[2], 'permit hash', 'HGET', k[2], owner))
  redis.call('ZADD', k[1], now + ttl, owner)
  settle(k, channel, changed, ttl)
  return {1, e.t}
end
-- the weight held is kept in the state hash: no holder needs reading but the first
local queued = typed(k[3], 'permit queue', 'ZRANGE', k[3], 0, -1)
local ahead, queued_here, head = 0, false, nil
if #queued > 0 then
  local before = {}  -- the entries ahead of this owner's
  for i = 1, #queued do
    if queued[i] == owner then queued_here = true break end
    before[i] = queued[i]
  end
  local entries = infos(k, before)
  head = entries[1]
  for i = 1, #entries do ahead = ahead + entries[i].w end
end
if used + ahead + weight <= limit then
  local left = #queued
  if queued_here then
    redis.call('ZREM', k[3], owner)
    typed(k[4], 'permit waits sorted set', 'ZREM', k[4], owner)
    left = left - 1
  end
  local token = next_token(k[6])
  redis.call('HSET', k[2], owner, cjson.encode({w = weight, t = token, i = identity, m = metadata}))
  redis.call('ZADD', k[1], now + ttl, owner)
  write_state(weight)
  settle(k, channel, changed, ttl, left, 1, fresh)
  return {1, token}
end
write_state(0)
-- A new request goes behind the last; a queued one keeps its place and its entry (the
-- weight it first asked with, which those behind count: rule 4), only its expiry reset.
local entry = cjson.encode({w = weight, t = 0, i = identity, m = metadata})
if not queued_here then
  local last = redis.call('ZRANGE', k[3], -1, -1, 'WITHSCORES')
  redis.call('ZADD', k[3], (tonumber(last[2]) or 0) + 1, owner)
  redis.call('HSET', k[2], owner, entry)
else
  redis.call('HSETNX', k[2], owner, entry)  -- (written again only if it was lost)
end
typed(k[4], 'permit waits sorted set', 'ZADD', k[4], now + ttl, owner)
settle(k, channel, changed, ttl)
local last = tonumber(redis.call('GET', k[6]) or '0') or 0
local holders = redis.call('ZRANGE', k[1], 0, 0, 'WITHSCORES')
if holders[1] then  -- the permit that expires first
  local first = decode(k, redis.call('HGET', k[2], holders[1]))
  return {0, holders[1], first.i, first.t, first.m, tonumber(holders[2]) - now, last}
end
-- only the queue blocks: its first entry (ahead of this one)
local expiry = tonumber(redis.call('ZSCORE', k[4], queued[1]))
return {0, queued[1], head.i, 0, '{}', expiry - now, last}
""",
)

PERMIT_RENEW = Script(
    "permit_renew",
    _PERMITS
    + r"""
-- ARGV: owner, token, ttl ms. 1 renewed, 0 not the owner's (expired, released, other).
local k = KEYS
local owner, ttl = ARGV[1], tonumber(ARGV[3])
local now = now_ms()
local score = typed(k[1], 'permits sorted set', 'ZSCORE', k[1], owner)
if not score or tonumber(score) <= now then return 0 end
local e = info_of(k, owner)
if not e or e.t ~= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', k[1], 'XX', now + ttl, owner)
if redis.call('PTTL', k[5]) < ttl then
  for i = 1, 5 do redis.call('PEXPIRE', k[i], ttl) end
end
return 1
""",
)

PERMIT_RELEASE = Script(
    "permit_release",
    _PERMITS
    + r"""
-- ARGV: owner, token ('' for any), channel. Frees the owner's live permit (1) or
-- drops its queue entry (0: the undo of a cancelled wait); 0 if neither.
local k = KEYS
local owner, token, channel = ARGV[1], ARGV[2], ARGV[3]
local changed = purge(k, now_ms())  -- (which checks the types of the sorted sets)
local freed, held = 0, nil
local e = info_of(k, owner)
if e and e.t > 0 then  -- a permit's entry (a queued one has token 0), live: purged else
  if (token == '' or e.t == tonumber(token)) and redis.call('ZREM', k[1], owner) == 1 then
    redis.call('HDEL', k[2], owner)
    -- no weight left: no permit left (each holds one at least), no ZCARD to settle
    if sub_used(k, e.w) == 0 then held = 0 end
    freed, changed = 1, true
  end
elseif typed(k[3], 'permit queue', 'ZREM', k[3], owner) == 1 then
  redis.call('ZREM', k[4], owner)
  redis.call('HDEL', k[2], owner)
  changed = true
elseif not e and token == '' and redis.call('ZREM', k[1], owner) == 1 then
  freed, changed = 1, true  -- a permit listed without its entry
end
if changed then settle(k, channel, true, nil, nil, held) end
return freed
""",
)

PERMIT_READ = Script(
    "permit_read",
    _PERMITS
    + r"""
-- ARGV: channel. false if nothing is live; else {limit, waiting, then per permit (by
-- expiry): owner, identity, token, metadata, pttl, weight}.
local k = KEYS
local now = now_ms()
if purge(k, now) then settle(k, ARGV[1], true, nil) end
local holders = redis.call('ZRANGE', k[1], 0, -1, 'WITHSCORES')
local waiting = redis.call('ZCARD', k[3])
if #holders == 0 and waiting == 0 then return false end
local out = {(state_of(k)) or 0, waiting}
if #holders > 0 then
  local owners = {}
  for i = 1, #holders, 2 do owners[#owners + 1] = holders[i] end
  local entries = infos(k, owners)
  for i = 1, #owners do
    local e = entries[i]
    local pttl = tonumber(holders[2 * i]) - now
    for _, v in ipairs({owners[i], e.i, e.t, e.m, pttl, e.w}) do out[#out + 1] = v end
  end
end
return out
""",
)
