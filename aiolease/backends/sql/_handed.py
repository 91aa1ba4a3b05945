"""The permits that a release granted to queue entries, as one backend object learns
of them (PostgreSQL's, MySQL / MariaDB's and SQLite's, ``docs/internals/semaphores.md``).

A release grants, in its own transaction, the queue entries that then fit (in arrival
order) and answers their owners, tokens and ttls. A waiter of the releasing backend
object takes its grant from that answer without another statement, if it asks with
the limit that its refused request gave (else the statement answers, and raises
:class:`~aiolease.LimitMismatchError`, as for any other request): its deadline counts
from when the release was sent, which is before the server started the grant's ttl.
A waiter elsewhere is told only that it was granted (a PostgreSQL notification, a
MySQL bell, SQLite's poll): it asks again, and its retry, answered as the holder's,
confirms the token. Only the waiters granted are woken, each on a key of its own
(:func:`turn_key`) in the backend's wake-ups (PostgreSQL's and MySQL's
:class:`~aiolease.backends.sql._wakeups.Wakeups`, whose ``wake_all``, after missed
notifications or on close, wakes them too): the others stay queued and send nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ...abc import Grant

__all__ = ["Handed", "turn_key"]

#: The most grants remembered (a grant that nobody takes, as one to a waiter that
#: stopped, is forgotten by its release; those of other backends' waiters are not).
_MAX_HANDED = 4096
#: A grant is taken without a statement only if its release was sent less than this
#: share of the ttl ago (else the waiter asks again, and gets a full ttl).
_FRESH_SHARE = 0.5


def turn_key(name: str, owner: str) -> str:
    """The key that wakes the waiter ``owner`` of the permits of ``name`` (a name never
    holds NUL), apart from the lock's keys."""
    return f"\x00permit:{name}\x00{owner}"


class Handed:
    """The grants that releases made to queue entries, until their waiters take them."""

    def __init__(self, wake: Callable[[str], None], clock: Callable[[], float]) -> None:
        """:param wake: wakes the waiter of a :func:`turn_key`
        :param clock: the core's clock (``Grant.sent_at`` is read on it)"""
        self._wake = wake
        self._clock = clock
        #: (name, owner) -> (token, ttl, send time of the release), or ``None``: granted
        #: (told by another backend object), to be confirmed by asking again.
        self._grants: dict[tuple[str, str], tuple[int, float, float] | None] = {}
        #: The requests asked for here, not yet granted or released: those a grant told
        #: by another backend object concerns.
        self._asking: set[tuple[str, str]] = set()
        #: The limit of each request refused here (its queue entry's), until it is
        #: granted or released: a grant is taken only by an ask with that limit.
        self._limits: dict[tuple[str, str], int] = {}
        #: The owners of those requests, by name (:meth:`queued_here`).
        self._by_name: dict[str, set[str]] = {}
        #: Names with releases in flight through this backend: how many, and the owners
        #: told granted meanwhile (told once the releases answered: a release's own
        #: notification may come before its answer, which hands the grant itself).
        self._releasing: dict[str, tuple[int, set[str]]] = {}

    def _put(self, key: tuple[str, str], grant: tuple[int, float, float] | None) -> None:
        if len(self._grants) >= _MAX_HANDED:
            self._grants.clear()  # grants nobody took (a safety net)
        self._grants[key] = grant
        self._wake(turn_key(*key))

    def granted(
        self,
        name: str,
        owners: Iterable[str],
        tokens: Iterable[int],
        ttls: Iterable[float],
        sent_at: float,
    ) -> None:
        """A release sent at ``sent_at`` (on the clock given) through this backend granted
        these queue entries."""
        for owner, token, ttl in zip(owners, tokens, ttls, strict=True):
            self._put((name, owner), (int(token), float(ttl), sent_at))

    def asking(self, name: str, owner: str) -> None:
        """``owner`` asks here (before its statement is sent: a grant may be told before
        its refusal is read): a grant told may be its."""
        if len(self._asking) >= _MAX_HANDED:
            self._asking.clear()  # requests that never came back (a safety net)
        self._asking.add((name, owner))

    def refused(self, name: str, owner: str, limit: int) -> None:
        """``owner``'s request of ``limit`` was refused here (and queued, with that
        limit): a grant that a release makes to its queue entry is for that limit."""
        if len(self._limits) >= _MAX_HANDED:
            self._limits.clear()  # requests that never came back (a safety net)
            self._by_name.clear()
        self._limits[name, owner] = limit
        self._by_name.setdefault(name, set()).add(owner)

    def queued_here(self, name: str) -> list[str]:
        """The owners whose requests of ``name`` were refused here (queued) and are not
        granted or released yet: a release through this backend hands them their
        grants in its answer."""
        return list(self._by_name.get(name, ()))

    def contended(self, name: str) -> bool:
        """Whether requests of ``name`` refused here wait: a new request is likely to be
        refused too, and others of this backend to ask with it (see ``Combiner.run``'s
        ``gather``)."""
        return name in self._by_name

    def _drop_limit(self, name: str, owner: str) -> int | None:
        owners = self._by_name.get(name)
        if owners is not None:
            owners.discard(owner)
            if not owners:
                del self._by_name[name]
        return self._limits.pop((name, owner), None)

    def releasing(self, name: str) -> None:
        """A release of ``name`` is sent through this backend: grants told meanwhile wait
        for :meth:`released` (its answer may hand them, without a statement)."""
        count, owners = self._releasing.get(name, (0, set()))
        self._releasing[name] = (count + 1, owners)

    def released(self, name: str) -> None:
        """A release of ``name`` through this backend ended (its grants, if any, handed
        by :meth:`granted`): the grants told meanwhile and not handed are told now."""
        count, owners = self._releasing.pop(name, (1, set()))
        if count > 1:
            self._releasing[name] = (count - 1, owners)
        elif owners:
            self.told(name, owners)

    def told(self, name: str, owners: Iterable[str]) -> None:
        """A release elsewhere (or through this backend, its answer not read yet) granted
        these owners' queue entries: those asking here ask again (after the releases of
        ``name`` in flight here answered)."""
        pending = self._releasing.get(name)
        if pending is not None:
            pending[1].update(owners)
            return
        for owner in owners:
            key = (name, owner)
            if key in self._asking and self._grants.get(key) is None:  # never over a
                self._put(key, None)  # grant that it can take

    def told_all(self, name: str) -> None:
        """A permit or queue entry of ``name`` went elsewhere, without granting (a
        release by a backend that saw nobody queue): every request asking here for
        ``name`` asks again."""
        for key in [key for key in self._asking if key[0] == name]:
            if self._grants.get(key) is None:
                self._put(key, None)

    def waiting(self, name: str, owner: str) -> bool:
        """Whether ``owner`` was granted since its latest ask: its wait ends at once."""
        return (name, owner) in self._grants

    def take(self, name: str, owner: str, ttl: float, limit: int) -> Grant | None:
        """The grant to take without a statement, if a release through this backend made
        it recently enough, and ``limit`` is the one that ``owner``'s refused request
        (its queue entry) gave; else ``None`` (and a grant that was only told, or is
        asked for with another limit, is dropped: the statement the caller sends now
        answers it, with :class:`~aiolease.LimitMismatchError` for another limit)."""
        grant = self._grants.pop((name, owner), None)
        if grant is None:
            return None
        self._asking.discard((name, owner))
        if self._drop_limit(name, owner) != limit:
            return None
        token, granted_ttl, sent_at = grant
        if self._clock() - sent_at >= ttl * _FRESH_SHARE:
            return None
        return Grant(token, min(ttl, granted_ttl), sent_at=sent_at)

    def forget(self, name: str, owner: str) -> None:
        """``owner`` was granted by its own ask, or released."""
        self._grants.pop((name, owner), None)
        self._asking.discard((name, owner))
        self._drop_limit(name, owner)
