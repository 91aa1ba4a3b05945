"""The Redis backend's Lua scripts: one script per operation, and how they are run.

The keys they are given are :mod:`aiolease.backends.redis._keys`'s. A script is called
with EVALSHA and loaded on NOSCRIPT (:func:`evaluate`).

**Only the next waiters are woken.** A release hands the lease to the queue's head
and publishes the hand-off on the head's own turns channel, which only its backend
(one process) subscribes, and tells the waiter behind it, on its turns channel, how
long the grant lasts if the head never picks it up (a dead head). The hand-off is
published on the name's ``changed`` channel too only when that is watched (a
``watched`` mark is live), when one of those two entries names no turns channel, or
when the hand-off follows an expiry (a grant after a lease ran out, which a holder
that outlived its lease must hear of). Every other process that waits, or held the
name before, hears nothing of it.

Scripts read the server's clock (``TIME``, allowed since
Redis 5 replicates scripts by their effects) only to date queue entries; lease
expiry is Redis's own ``PEXPIRE``.

Scripts never overwrite what they do not recognise: a key of the wrong type, a
hash without the fields of a lease, a lease without an expiry, or a counter that
is not a positive integer raises an error starting with :data:`FOREIGN` (a counter
of ``0``, which aiolease never writes, counts as unused). The hot paths ask no
``TYPE``: the first command on each key runs under ``pcall``, and a ``WRONGTYPE``
refusal, which writes nothing, is reported as foreign; every request and every
``redis.call`` counts, as the server runs these cache-cold between requests.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import NoScriptError

__all__ = [
    "ACQUIRE",
    "FOREIGN",
    "LEASE_FUNCTIONS",
    "READ",
    "READ_BODY",
    "RELEASE",
    "RENEW",
    "RENEW_MANY",
    "UPDATE_METADATA",
    "WATCH",
    "Script",
    "evaluate",
    "ms",
]

#: How a script's error about a foreign value under our keys starts.
FOREIGN = "AIOLEASE_FOREIGN"


@dataclass(frozen=True)
class Script:
    """A Lua script and its SHA-1 (what EVALSHA names it by).

    :ivar sha: the SHA-1 of the source, as ``SCRIPT LOAD`` reports it
    """

    name: str
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha1(self.source.encode(), usedforsecurity=False).hexdigest()
        object.__setattr__(self, "sha", digest)


async def evaluate(
    call: Callable[..., Awaitable[Any]], script: Script, keys: Sequence[bytes], *args: Any
) -> Any:
    """Run ``script`` by EVALSHA through ``call`` (one command, raising the driver's
    errors), loading it first if the server answers NOSCRIPT.

    :raises redis.exceptions.RedisError: what ``call`` raises
    """
    try:
        return await call("EVALSHA", script.sha, len(keys), *keys, *args)
    except NoScriptError:
        await call("SCRIPT LOAD", script.source)
    return await call("EVALSHA", script.sha, len(keys), *keys, *args)


def ms(seconds: float) -> int:
    """A duration as the scripts take it: whole milliseconds, at least 1."""
    # Rounded up: the server never lets a lease go before the holder's deadline.
    return max(math.ceil(seconds * 1000), 1)


#: The Lua functions every script that reads a lease uses (the Redlock scripts too):
#: ``foreign``, ``exists_as``, ``is_count``, ``load_lease`` and ``holder``.
LEASE_FUNCTIONS = (
    f"\nlocal FOREIGN = '{FOREIGN}'\n"
    + r"""
local function foreign(key, what)
  error({err = FOREIGN .. ' ' .. key .. ' ' .. what})
end

-- Whether key exists; a value of another type is an error, never overwritten.
local function exists_as(key, want)
  local kind = redis.call('TYPE', key)['ok']
  if kind ~= 'none' and kind ~= want then
    foreign(key, 'holds a ' .. kind .. ', not the ' .. want .. ' aiolease keeps there')
  end
  return kind ~= 'none'
end

local function is_count(value)
  return type(value) == 'string' and string.match(value, '^[1-9]%d*$') ~= nil
end

-- The live lease under key, or nil. (HMGET first: a held lease, the common case,
-- costs no TYPE; an error or nothing found tells to look at the type.) Its pttl
-- too, unless `no_pttl` (a release needs none).
local function load_lease(key, no_pttl)
  local f = redis.pcall('HMGET', key, 'owner', 'identity', 'token', 'metadata')
  if f.err or not (f[1] or f[2] or f[3] or f[4]) then
    if not exists_as(key, 'hash') then return nil end
  end
  if f.err or not f[1] or not f[2] or not is_count(f[3]) or not f[4] then
    foreign(key, 'is a hash without the fields of an aiolease lease')
  end
  local lease = {owner = f[1], identity = f[2], token = tonumber(f[3]), metadata = f[4]}
  if not no_pttl then
    lease.pttl = redis.call('PTTL', key)
    if lease.pttl < 0 then foreign(key, 'has no expiry, which an aiolease lease always has') end
  end
  return lease
end

local function holder(lease)
  return {0, lease.owner, lease.identity, lease.token, lease.metadata, lease.pttl}
end
"""
)

_PRELUDE = (
    LEASE_FUNCTIONS
    + r"""
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""
)

#: The body of both backends' READ script (KEYS[1]: the lease).
READ_BODY = r"""
local lease = load_lease(KEYS[1])
if not lease then return false end
return holder(lease)
"""

_QUEUE = r"""
-- A call whose error on a key of the wrong type means a foreign value: no TYPE is
-- asked first, as a value of another type makes Redis refuse the command anyway.
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

-- INCR of the counter; INCR refuses a value that is not an integer. ("0", which
-- aiolease never writes, counts as a counter not yet used.)
local function next_token(key)
  local token = redis.pcall('INCR', key)
  if type(token) == 'table' or token < 1 then
    if type(token) ~= 'table' then redis.call('DECR', key) end  -- put it back
    foreign(key, 'is not an aiolease token counter (a positive integer)')
  end
  return token
end

-- Whether the name has a queue; absent unless somebody waits in fair mode, and
-- then nothing else needs looking at. (Its waiters hash is written and expires
-- with it; the types are checked by the calls that use them.)
local function has_queue(queue)
  return redis.call('EXISTS', queue) == 1
end

-- A waiter's entry from its raw value (nil if none).
local function entry_of(waiters, raw)
  if not raw then return nil end
  local ok, e = pcall(cjson.decode, raw)
  if not ok or type(e) ~= 'table' or type(e.e) ~= 'number' or type(e.w) ~= 'number'
      or type(e.t) ~= 'number' or type(e.i) ~= 'string' or type(e.m) ~= 'string'
      or (e.c ~= nil and type(e.c) ~= 'string') then
    foreign(waiters, 'holds an entry that is not an aiolease waiter')
  end
  return e
end

local function dequeue(queue, waiters, owner)
  redis.call('ZREM', queue, owner)
  redis.call('HDEL', waiters, owner)
end

-- The waiter at `at` (0: the head) whose entry has not expired, stale ones there
-- dropped; nil if none is left.
local function live_waiter(queue, waiters, now, at)
  while true do
    local first = typed(queue, 'queue', 'ZRANGE', queue, at, at)[1]
    if not first then return nil end
    local entry = entry_of(waiters, typed(waiters, 'waiters hash', 'HGET', waiters, first))
    if entry and entry.e > now then return first, entry end
    dequeue(queue, waiters, first)
  end
end

-- The first two live waiters and their entries (the second nil if there is none),
-- and the time `now` (read from the server if not given and somebody is queued); nil
-- if nobody waits. One read of each key while the first two are live, as they nearly
-- always are; stale entries in front are dropped.
local function queue_front(queue, waiters, now)
  local ids = typed(queue, 'queue', 'ZRANGE', queue, 0, 1)
  if not ids[1] then return nil end
  now = now or now_ms()
  local raw = typed(waiters, 'waiters hash', 'HMGET', waiters, unpack(ids))
  local head, after = entry_of(waiters, raw[1]), entry_of(waiters, raw[2])
  if head and head.e > now and (not ids[2] or (after and after.e > now)) then
    return ids[1], head, ids[2], after, now
  end
  local first, entry = live_waiter(queue, waiters, now, 0)
  if not first then return nil end
  local second, second_entry = live_waiter(queue, waiters, now, 1)
  return first, entry, second, second_entry, now
end

-- A refused waiter keeps its place; its entry lasts one ttl. It retries (so refreshes
-- the entry) by `retry_by` at the latest: a third of its ttl, or the holder's expiry.
-- Its hand-off is announced on `turns` (its backend's channel), when given.
local function enqueue(queue, waiters, owner, ttl, identity, metadata, now, retry_by, turns)
  local last = typed(queue, 'queue', 'ZRANGE', queue, -1, -1, 'WITHSCORES')
  local entry = {e = now + ttl, w = retry_by, t = ttl, i = identity, m = metadata}
  if turns ~= '' then entry.c = turns end
  typed(waiters, 'waiters hash', 'HSET', waiters, owner, cjson.encode(entry))
  -- behind the last; a waiter queued already keeps its place (NX)
  redis.call('ZADD', queue, 'NX', (tonumber(last[2]) or 0) + 1, owner)
  -- the two keys are written together: the queue's expiry stands for both
  if redis.call('PTTL', queue) < ttl then
    redis.call('PEXPIRE', queue, ttl)
    redis.call('PEXPIRE', waiters, ttl)
  end
end

-- Write a new grant of the (free) lease; its token.
local function grant(k, owner, identity, metadata, px)
  local token = next_token(k[2])
  redis.call('HSET', k[1], 'owner', owner, 'identity', identity,
             'token', string.format('%d', token), 'metadata', metadata)
  redis.call('PEXPIRE', k[1], px)
  return token
end

-- Grant the free lease to the queue's head, and announce it as "<owner>\n<token>:<px>"
-- (the waiter's confirmation, see _tickets) on the head's turns channel, and on
-- the name's channel if `announce` (or a waiter concerned has no turns channel). The
-- lease lasts what is left of the head's entry until it picks it up: the waiter next
-- in line is told how long ("<owner>\n+<px>"), and retries when it ends if it was not
-- handed the lease by then (a dead head holds nobody up longer).
-- Redis writes what is pending for its clients newest first: the head's message is
-- published last, so that the head hears of its turn first. A waiter next in line
-- behind a head of its own backend (the same turns channel) is not told: the head's
-- process is alive when it is, and a head that gives up there releases what it was
-- handed (the core's compensating release).
local function hand_off(k, head, entry, after, after_entry, now, channel, announce)
  dequeue(k[3], k[4], head)
  local px = math.max(math.min(entry.t, entry.e - now), 1)
  local token = grant(k, head, entry.i, entry.m, px)
  local message = head .. string.format('\n%d:%d', token, px)
  if after and after_entry.c and after_entry.c ~= entry.c then
    redis.call('PUBLISH', after_entry.c, after .. string.format('\n+%d', px))
  end
  if announce or not entry.c or (after and not after_entry.c) then
    redis.call('PUBLISH', channel, message)
  end
  if entry.c then redis.call('PUBLISH', entry.c, message) end
  return {owner = head, identity = entry.i, token = token, metadata = entry.m, pttl = px}
end
"""

# The attempt of ACQUIRE, also run by RELEASE for the attempts that ride with it.
_ATTEMPT = r"""
-- The rest of an attempt that finds `lease` held by another owner at `now`: queued
-- behind it in fair mode; the holder.
local function queue_behind(k, lease, now, owner, ttl, identity, metadata, fair, turns)
  if fair then
    now = now or now_ms()
    local retry_by = now + math.min(math.floor(ttl / 3), lease.pttl + 2)
    enqueue(k[3], k[4], owner, ttl, identity, metadata, now, retry_by, turns)
  end
  return holder(lease)
end

-- k: lease, token, queue, waiters, watched; fair: a boolean; turns: '' for none
local function attempt(k, owner, ttl, identity, metadata, fair, channel, turns)
  local lease = load_lease(k[1])
  if lease and lease.owner == owner then
    -- an idempotent retry, or a hand-off this waiter now picks up: reset the expiry
    redis.call('PEXPIRE', k[1], ttl)
    return {1, lease.token}
  end
  local now  -- the clock only dates queue entries: read when one is read or written
  if not lease then
    local head, entry, after, after_entry
    -- nobody queued and nobody watching (the common case) costs this one call
    local waited = redis.call('EXISTS', k[3], k[5]) > 0
    if waited and has_queue(k[3]) then
      local read_at
      head, entry, after, after_entry, read_at = queue_front(k[3], k[4], now)
      now = read_at or now
    end
    if not head or head == owner then
      if head then dequeue(k[3], k[4], owner) end
      local token = grant(k, owner, identity, metadata, ttl)
      if waited and redis.call('EXISTS', k[5]) == 1 then
        redis.call('PUBLISH', channel, owner)  -- for those who watch the name
      end
      return {1, token}
    end
    -- the lease ran out with a waiter queued: a grant after an expiry, for all to hear
    lease = hand_off(k, head, entry, after, after_entry, now, channel, true)
  end
  return queue_behind(k, lease, now, owner, ttl, identity, metadata, fair, turns)
end
"""

ACQUIRE = Script(
    "acquire",
    _PRELUDE
    + _QUEUE
    + _ATTEMPT
    + r"""
-- KEYS: lease, token, queue, waiters, watched
-- ARGV: owner, ttl ms, identity, metadata, fair ('1'/'0'), channel, turns channel ('')
return attempt(KEYS, ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5] == '1', ARGV[6],
               ARGV[7] or '')
""",
)

RELEASE = Script(
    "release",
    _PRELUDE
    + _QUEUE
    + _ATTEMPT
    + r"""
local function release(k, owner, token, channel)
  local lease = load_lease(k[1], true)
  -- also undo a queue entry this owner left behind (a cancelled wait); a queue member
  -- without a waiter entry is dropped when it comes to the head
  -- (A lease's holder has none: a grant dequeues its waiter.)
  if token == '' and has_queue(k[3])
      and typed(k[4], 'waiters hash', 'HDEL', k[4], owner) == 1 then
    redis.call('ZREM', k[3], owner)
  end
  if not lease or lease.owner ~= owner or (token ~= '' and lease.token ~= tonumber(token)) then
    return 0
  end
  -- nobody queued and nobody watching (the common case): no work for waiters
  if redis.call('EXISTS', k[3], k[5]) == 0 then
    redis.call('DEL', k[1])
    return 1
  end
  local watched = redis.call('EXISTS', k[5]) == 1
  local head, entry, after, after_entry, now = queue_front(k[3], k[4], nil)
  if head then
    -- rewrites every field; announced on the name's channel only if it is watched
    return {2, head}, hand_off(k, head, entry, after, after_entry, now, channel, watched), now
  end
  redis.call('DEL', k[1])
  if watched then redis.call('PUBLISH', channel, '') end
  return 1
end

-- KEYS: lease, token, queue, waiters, watched
-- ARGV: owner, token ('' for any), channel; then, for each attempt that rides with the
-- release (see _riders), ACQUIRE's seven arguments.
local reply, handed, now = release(KEYS, ARGV[1], ARGV[2], ARGV[3])
if #ARGV == 3 then return reply end
-- {release's reply, each attempt's}: an attempt that fails fails alone. After a
-- hand-off, what an attempt would read is known: the new holder, at `now`.
local replies = {reply}
for i = 4, #ARGV, 7 do
  local owner, ttl, identity, metadata = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3]
  local fair, channel, turns = ARGV[i + 4] == '1', ARGV[i + 5], ARGV[i + 6] or ''
  local ok, got
  if handed and handed.owner ~= owner then
    ok, got = pcall(queue_behind, KEYS, handed, now, owner, ttl, identity, metadata, fair, turns)
  else
    ok, got = pcall(attempt, KEYS, owner, ttl, identity, metadata, fair, channel, turns)
  end
  if not ok and not (type(got) == 'table' and got.err) then got = {err = tostring(got)} end
  replies[#replies + 1] = got
end
return replies
""",
)

RENEW = Script(
    "renew",
    _PRELUDE
    + r"""
-- KEYS: lease; ARGV: owner, token, ttl ms
local lease = load_lease(KEYS[1])
if not lease or lease.owner ~= ARGV[1] or lease.token ~= tonumber(ARGV[2]) then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
""",
)

RENEW_MANY = Script(
    "renew_many",
    _PRELUDE
    + r"""
-- KEYS: leases (one slot, or one server); ARGV: owner, token, ttl ms per key.
-- One reply per key: 1 renewed, 0 not the owner's, or the error of a foreign key
-- (that key fails alone).
local out = {}
for i = 1, #KEYS do
  local owner, token, px = ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i]
  local ok, lease = pcall(load_lease, KEYS[i])
  if not ok then
    out[i] = type(lease) == 'table' and lease or {err = tostring(lease)}
  elseif not lease or lease.owner ~= owner or lease.token ~= tonumber(token) then
    out[i] = 0
  else
    redis.call('PEXPIRE', KEYS[i], px)
    out[i] = 1
  end
end
return out
""",
)

UPDATE_METADATA = Script(
    "update_metadata",
    LEASE_FUNCTIONS
    + r"""
-- KEYS: lease; ARGV: owner, token, metadata, channel. The holder's new metadata (the
-- key keeps its expiry), announced as a grant to the holder: watchers look, and the
-- holder's own takeover watch takes it for its own grant's message.
local lease = load_lease(KEYS[1], true)
if not lease or lease.owner ~= ARGV[1] or lease.token ~= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'metadata', ARGV[3])
redis.call('PUBLISH', ARGV[4], ARGV[1])
return 1
""",
)

READ = Script("read", LEASE_FUNCTIONS + READ_BODY)

WATCH = Script(
    "watch",
    LEASE_FUNCTIONS
    + r"""
-- KEYS: watched; ARGV: ms. Mark the name watched for ms (see the module's docstring).
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'none' and (kind ~= 'string' or redis.call('GET', KEYS[1]) ~= '1') then
  foreign(KEYS[1], 'is not an aiolease watch mark')
end
redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
return 1
""",
)
