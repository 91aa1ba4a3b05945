"""The Redis backend's key layout: the keys and channels of one lease name.

Every key of one lease name shares one Redis Cluster hash tag, ``{<name>}``, so each
script touches a single slot::

    <prefix>{<name>}:lease     HASH owner, identity, token, metadata; PX = the ttl
    <prefix>{<name>}:token     STRING, the fencing token counter (INCR; never expires)
    <prefix>{<name>}:queue     ZSET owner -> arrival number (fair mode's waiters)
    <prefix>{<name>}:waiters   HASH owner -> JSON {e: expiry ms, w: retry-by ms, t: ttl ms,
                               i: identity, m: metadata, c: the waiter's turns channel}:
                               what a hand-off needs
    <prefix>{<name>}:watched   STRING "1" with a PX: somebody waits for the name's holder
                               to change (``wait_changed``), so releases announce hand-offs
    <prefix>{<name>}:changed   pub/sub channel: the new owner (for a hand-off to a
                               waiter followed by "\\n<token>:<px>"), or "" when freed
    <prefix>turns:<id>         pub/sub channel of one fair backend object: the hand-offs
                               to its waiters (the same message as on ``changed``), and
                               "<owner>\\n+<px>" to a waiter next in line behind one
                               (of another backend object)

The permits of a name (semaphores and read-write locks, ``docs/internals/semaphores.md``)
live in keys of their own under the same tag::

    <prefix>{<name>}:permits         ZSET owner -> expiry (ms of the server's TIME)
    <prefix>{<name>}:permit_info     HASH owner -> JSON {w: weight, t: token (0 while
                                     queued), i: identity, m: metadata}
    <prefix>{<name>}:permit_queue    ZSET owner -> arrival number (refused requests)
    <prefix>{<name>}:permit_waits    ZSET owner -> queue entry expiry (ms, server time)
    <prefix>{<name>}:permit_state    HASH limit: the limit of the live permits and
                                     queue entries; used: the weight the permits hold
    <prefix>{<name>}:permit_token    STRING, the permits' token counter (INCR; never
                                     expires; one per name, whatever the weight)
    <prefix>{<name>}:permits_changed pub/sub channel: "" when a permit or queue entry
                                     went while somebody is queued

The first five expire (PEXPIRE) no sooner than their latest entry and are deleted
when the last entry goes.

``{``, ``}`` and ``%`` in a name are percent-encoded inside the tag, so the tag is
always the whole name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..._exceptions import InvalidArgument

__all__ = ["DEFAULT_PREFIX", "Keys", "PermitKeys", "check_prefix", "keys_of", "permit_keys_of"]

#: The key prefix used when none is given.
DEFAULT_PREFIX = "aiolease:"
MAX_PREFIX_BYTES = 128


def check_prefix(prefix: object) -> str:
    """:raises InvalidArgument: unless ``prefix`` is 1-128 bytes of printable UTF-8 without
    ``{``, ``}`` or spaces (a brace would move the Cluster hash tag into the prefix)"""
    if not isinstance(prefix, str):
        raise InvalidArgument(f"key prefix must be a str, not {type(prefix).__name__}")
    if not prefix or len(prefix.encode("utf-8", "surrogatepass")) > MAX_PREFIX_BYTES:
        raise InvalidArgument(f"key prefix must be 1 to {MAX_PREFIX_BYTES} bytes, got {prefix!r}")
    bad = sorted({c for c in prefix if c in "{}" or not c.isprintable() or c.isspace()})
    if bad:
        raise InvalidArgument(
            f"key prefix {prefix!r} contains {bad!r}: braces, spaces and control characters"
            " are not allowed"
        )
    try:
        prefix.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"key prefix {prefix!r} is not valid UTF-8 text: {exc}") from None
    return prefix


def _tag(name: str) -> str:
    return name.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


@dataclass(frozen=True, slots=True)
class Keys:
    """The keys and channel of one lease name (all in one hash slot)."""

    lease: bytes
    token: bytes
    queue: bytes
    waiters: bytes
    watched: bytes
    channel: bytes

    @classmethod
    def of(cls, prefix: str, name: str) -> Keys:
        """The keys of ``name`` under ``prefix``."""
        base = f"{prefix}{{{_tag(name)}}}:".encode()
        return cls(
            base + b"lease",
            base + b"token",
            base + b"queue",
            base + b"waiters",
            base + b"watched",
            base + b"changed",
        )

    @property
    def all(self) -> tuple[bytes, bytes, bytes, bytes, bytes]:
        """The five keys every write script is given, in order."""
        return (self.lease, self.token, self.queue, self.waiters, self.watched)


@functools.lru_cache(maxsize=1024)
def keys_of(prefix: str, name: str) -> Keys:
    """:meth:`Keys.of`, remembered for the names used most recently."""
    return Keys.of(prefix, name)


@dataclass(frozen=True, slots=True)
class PermitKeys:
    """The keys and channel of one name's permits (all in the name's hash slot)."""

    held: bytes
    info: bytes
    queue: bytes
    waits: bytes
    state: bytes
    token: bytes
    channel: bytes

    @classmethod
    def of(cls, prefix: str, name: str) -> PermitKeys:
        """The permit keys of ``name`` under ``prefix``."""
        base = f"{prefix}{{{_tag(name)}}}:".encode()
        return cls(
            base + b"permits",
            base + b"permit_info",
            base + b"permit_queue",
            base + b"permit_waits",
            base + b"permit_state",
            base + b"permit_token",
            base + b"permits_changed",
        )

    @property
    def all(self) -> tuple[bytes, bytes, bytes, bytes, bytes, bytes]:
        """The six keys every permit script is given, in order."""
        return (self.held, self.info, self.queue, self.waits, self.state, self.token)


@functools.lru_cache(maxsize=1024)
def permit_keys_of(prefix: str, name: str) -> PermitKeys:
    """:meth:`PermitKeys.of`, remembered for the names used most recently."""
    return PermitKeys.of(prefix, name)
