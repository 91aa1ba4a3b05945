"""The Lua scripts that every Redlock instance runs: one per operation, one instance each.

Keys per lease name on each instance (the one-server backend's layout, see
:class:`aiolease.backends.redis._keys.Keys`, of which Redlock uses three)::

    <prefix>{<name>}:lease     HASH owner, identity, token, metadata; PX = the ttl
    <prefix>{<name>}:token     STRING, this instance's token counter (never expires)
    <prefix>{<name>}:changed   pub/sub channel: the new owner, or "" when freed

**Tokens are per instance.** A grant takes the instance's ``counter + 1``, and the
client hands out the highest of its quorum; renew and release are given the
token the client was handed (the highest of its quorum) and, where that client holds
the lease, raise the counter and the lease record to at least that. So every instance
a holder reached carries its token forward, and any later majority overlaps one of
them. A grant that was never handed out (its acquire failed or was abandoned) gives
its token back on release, if nothing was granted there since, so that a failed
acquire does not put one instance ahead of the others. That is ordering in the
absence of faults, not a fence: see :mod:`aiolease.backends.redlock`.

Scripts never overwrite what they do not recognise: a key of the wrong type, a hash
without the fields of a lease, a lease without an expiry, or a counter that is not a
positive integer raises an error starting with :data:`FOREIGN` (the one-server
backend's marker, so :class:`~aiolease.backends.redis.ForeignDataError` is raised).
"""

from __future__ import annotations

from ..redis._shared import FOREIGN, LEASE_FUNCTIONS, READ_BODY, Script

__all__ = ["ACQUIRE", "FOREIGN", "READ", "RELEASE", "RENEW", "UPDATE_METADATA"]

_PRELUDE = (
    LEASE_FUNCTIONS
    + r"""
local function counter(key)
  if not exists_as(key, 'string') then return 0 end
  local value = redis.call('GET', key)
  if not is_count(value) then
    foreign(key, 'is not an aiolease token counter (a positive integer)')
  end
  return tonumber(value)
end

-- If owner holds the lease here, raise the counter and the lease record to at least
-- token (the token the client was handed). Nobody else's word moves a counter.
local function carry(k, lease, owner, token)
  if not lease or lease.owner ~= owner then return end
  if token > counter(k[2]) then
    redis.call('SET', k[2], string.format('%d', token))
  end
  if lease.token < token then
    redis.call('HSET', k[1], 'token', string.format('%d', token))
  end
end

"""
)

ACQUIRE = Script(
    "redlock-acquire",
    _PRELUDE
    + r"""
-- KEYS: lease, token; ARGV: owner, ttl ms, identity, metadata, channel
-- Returns {1, token, fresh}: fresh is 1 for a new grant, 0 for a retry of the current one.
local owner, ttl = ARGV[1], tonumber(ARGV[2])
local lease = load_lease(KEYS[1])
local count = counter(KEYS[2])
if lease and lease.owner == owner then
  -- an idempotent retry: reset the expiry, keep the grant
  redis.call('PEXPIRE', KEYS[1], ttl)
  return {1, lease.token, 0}
end
if lease then return holder(lease) end
local token = count + 1
local text = string.format('%d', token)
redis.call('SET', KEYS[2], text)
redis.call('HSET', KEYS[1], 'owner', owner, 'identity', ARGV[3], 'token', text,
           'metadata', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PUBLISH', ARGV[5], owner)
return {1, token, 1}
""",
)

RENEW = Script(
    "redlock-renew",
    _PRELUDE
    + r"""
-- KEYS: lease, token; ARGV: owner, token, ttl ms
-- The instance may hold another token than the client's (the highest of its quorum):
-- the owner id, unique per acquire attempt, alone identifies the grant.
local owner, token = ARGV[1], tonumber(ARGV[2])
local lease = load_lease(KEYS[1])
carry(KEYS, lease, owner, token)
if not lease or lease.owner ~= owner then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
""",
)

RELEASE = Script(
    "redlock-release",
    _PRELUDE
    + r"""
-- KEYS: lease, token; ARGV: owner, token ('' when unknown), channel, undo ('1'/'0')
-- undo: the grant was never handed to anyone (its acquire failed or was abandoned), so
-- its token is taken back if no grant came since; the instance stays in step.
local owner, token = ARGV[1], ARGV[2]
local lease = load_lease(KEYS[1])
if token ~= '' then carry(KEYS, lease, owner, tonumber(token)) end
if not lease or lease.owner ~= owner then return 0 end
if ARGV[4] == '1' and counter(KEYS[2]) == lease.token then
  if lease.token > 1 then
    redis.call('SET', KEYS[2], string.format('%d', lease.token - 1))
  else
    redis.call('DEL', KEYS[2])
  end
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[3], '')
return 1
""",
)

UPDATE_METADATA = Script(
    "redlock-update-metadata",
    _PRELUDE
    + r"""
-- KEYS: lease, token; ARGV: owner, token, metadata, channel
-- The holder's new metadata here (the key keeps its expiry), announced as a grant to
-- the holder: watchers look again. As for a renewal, the owner id names the grant.
local owner, token = ARGV[1], tonumber(ARGV[2])
local lease = load_lease(KEYS[1], true)
carry(KEYS, lease, owner, token)
if not lease or lease.owner ~= owner then return 0 end
redis.call('HSET', KEYS[1], 'metadata', ARGV[3])
redis.call('PUBLISH', ARGV[4], owner)
return 1
""",
)

READ = Script("redlock-read", _PRELUDE + READ_BODY)  # KEYS: lease, token
