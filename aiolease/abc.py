"""The backend contract: everything a backend author imports.

A backend stores, per lease *name*, at most one live record::

    (owner, identity, token, metadata, server-side expiry)

and a per-name token counter that outlives the record (release and expiry keep it),
so that every grant's token is strictly greater than every earlier grant's.

Rules every implementation keeps (the conformance checks in
:mod:`aiolease.testing` prove them against a real server):

* **Atomic, one round trip.** Each operation is one atomic step on the server.
* **Server time decides expiry.** A backend never compares a client's wall clock
  with another machine's; expiry is computed where the record lives.
* **Idempotent retries.** ``try_acquire`` by the current owner returns the current
  grant (same token) and resets the expiry; ``release`` of something not held
  returns ``False``.
* **Checked arguments.** A bad lease name (not a non-empty str of at most 255
  UTF-8 bytes without NUL) or ttl (not in (0, 365 days]) raises
  :class:`InvalidArgument` before a backend's own method runs: the base class wraps
  every contract method a subclass defines with the checks, so an implementation
  gets only valid ones, and a bad call changes nothing.
* **Mapped errors.** Driver exceptions are raised as :class:`BackendUnavailable`
  or :class:`BackendTimeout` ``from`` the original.
* **Loop neutrality.** A backend whose driver runs only on asyncio sets
  ``requires_asyncio = True``; the core then bridges it when the application runs
  under trio. The backend itself never asks which loop it is on.

Backends with sessions (etcd leases, ZooKeeper sessions, Kafka group membership)
may carry many leases on one session and renew it once per tick. They report in
:attr:`Grant.sent_at` the monotonic time at which the confirming request was
sent; the core takes the earlier of that and its own send time, so a confirmation
is never counted as younger than it is.

What an author writes. Required: :meth:`Backend.from_url`,
:meth:`~Backend.try_acquire`, :meth:`~Backend.renew`, :meth:`~Backend.release`,
:meth:`~Backend.read`, and :attr:`~Backend.capabilities` (a class attribute, or a
property when a mode changes them). Everything else is optional, and the core does
without it as follows:

* :meth:`~Backend.wait_changed`: the default reads, then sleeps until the holder's
  ttl runs out (or :attr:`~Backend.poll_interval`): waiters poll.
* :meth:`~Backend.renew_many`: the default renews one by one, and the core then
  renews each lease in a task of its own (overriding it makes
  :attr:`~Backend.renews_many` true: the core hands it every lease due at once).
* :meth:`~Backend.release_now`: the core awaits :meth:`~Backend.release` instead.
* :meth:`~Backend.update_metadata` (:attr:`Capability.PROCLAIM`): the default raises
  :class:`UnsupportedCapability`, and :meth:`Elector.proclaim <aiolease.Elector.proclaim>`
  with it.
* :meth:`~Backend.wait_turn` (:attr:`Capability.FAIR_QUEUE`): the default is
  :meth:`~Backend.wait_changed`.
* :meth:`~Backend.on_taken` (:attr:`Capability.PUSH_WAKEUP`): reports a takeover of
  a held lease by callback. Without it the core runs a watch task per held lease
  that waits in :meth:`~Backend.wait_taken` and then reads; the default
  :meth:`~Backend.wait_taken` uses :meth:`~Backend.on_taken` when it subscribes,
  else :meth:`~Backend.wait_changed`, so a backend overrides it only to wait for its
  notifications without such a subscription.
* :meth:`~Backend.hold` (:attr:`Capability.SESSION`): a session backend whose
  ``renew`` is only local bookkeeping (the session's own keepalive is what keeps the
  keys) returns the session's clock (:class:`SessionClock`): the core then never
  renews the leases it holds through it, their local deadlines follow the session's
  confirmed expiry, and the backend reports every end of the grant, takeovers
  included, through ``ended`` (the core then runs no watch of its own). Without it
  the core renews, and watches with :meth:`~Backend.wait_lost`.
* :meth:`~Backend.wait_lost` (:attr:`Capability.SESSION`): the awaited form of
  :meth:`~Backend.hold`'s ``ended``, for a backend that cannot keep grants itself (a
  client of a backend served over the wire); the default never reports a loss, and
  the core then learns of one at the next renewal.

Permits (:attr:`Capability.SEMAPHORE`): :meth:`~Backend.try_acquire_permit`,
:meth:`~Backend.read_permits` and :meth:`~Backend.wait_permit_turn` serve
:class:`~aiolease.AsyncSemaphore` and :class:`~aiolease.AsyncReadWriteLock`; their
defaults refuse (:class:`UnsupportedCapability`). A permit is then addressed like a
lease, by ``(name, owner, token)``: the lease operations above serve it when
:func:`is_permit_owner` says ``owner`` is a permit's. ``docs/internals/semaphores.md``
has the rules.

Wrappers (the trio bridge, :class:`~aiolease.testing.faults.FaultyBackend`,
:class:`~aiolease.testing.remote.RemoteBackend`) derive from
:class:`ForwardingBackend`, which hands every operation, hook and property of the
contract to the backend they wrap. A wrapper of this process (:class:`WrappingBackend`)
also shares the wrapped backend's :attr:`Backend.events`, the observers of the leases
held through it (:class:`~aiolease.Observer`), which the core tells of every grant,
release, renewal and loss.
"""

from __future__ import annotations

import abc
import enum
import functools
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, ClassVar, overload

import anyio

from ._checked import install, returns_within_ttl
from ._events import Events
from ._exceptions import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    InvalidArgument,
    LossReason,
    NotOwnerError,
    UnsupportedCapability,
)
from ._permits import PermitHolders, is_permit_owner, permit_owner
from ._records import Grant, HolderInfo, Renewal, SessionClock, state_of

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

__all__ = [
    "Backend",
    "BackendError",
    "BackendTimeout",
    "BackendUnavailable",
    "Capability",
    "ForwardingBackend",
    "Grant",
    "HolderInfo",
    "InvalidArgument",
    "LossReason",
    "NotOwnerError",
    "PermitHolders",
    "Renewal",
    "RenewResult",
    "RenewedAsAsked",
    "SessionClock",
    "UnsupportedCapability",
    "WrappingBackend",
    "is_permit_owner",
    "permit_owner",
]


class Capability(str, enum.Enum):
    """What a backend can do, declared by the backend (never discovered by failure)."""

    #: ``wait_changed`` returns as soon as the holder changes (no polling by ttl).
    PUSH_WAKEUP = "push_wakeup"
    #: Waiters are granted in arrival order.
    FAIR_QUEUE = "fair_queue"
    #: Expiry is computed on the server's clock.
    SERVER_TIME = "server_time"
    #: Tokens survive a restart of the server.
    DURABLE_TOKENS = "durable_tokens"
    #: Leases ride on a session renewed once per tick for all of them.
    SESSION = "session"
    #: Safe across several processes (not only several tasks of one process).
    MULTI_PROCESS = "multi_process"
    #: The holder can change the metadata of its grant in place
    #: (:meth:`Backend.update_metadata`: same token, same expiry, watchers woken), which
    #: :meth:`Elector.proclaim <aiolease.Elector.proclaim>` needs.
    PROCLAIM = "proclaim"
    #: Serves :class:`~aiolease.Elector` only: :class:`~aiolease.AsyncLock` refuses it
    #: (:class:`~aiolease.UnsupportedCapability`), as every acquire would cost what a
    #: campaign costs there (Kafka: a rebalance of the group).
    ELECTION_ONLY = "election_only"
    #: Serves permits (:class:`~aiolease.AsyncSemaphore`,
    #: :class:`~aiolease.AsyncReadWriteLock`): :meth:`Backend.try_acquire_permit`,
    #: :meth:`Backend.read_permits`, and the lease operations serve permits too.
    SEMAPHORE = "semaphore"
    #: Permit requests are queued and served in arrival order (readers and writers
    #: alike); without it, a backend with :attr:`SEMAPHORE` prefers writers.
    FAIR_PERMITS = "fair_permits"
    #: A queued permit request retried with another weight, and refused, keeps its
    #: place in the queue and the weight it first asked with (rule 4 of
    #: ``docs/internals/semaphores.md``); without it (ZooKeeper) such a retry is taken
    #: for a new request at the back of the queue. The core retries with the weight it
    #: first asked with, so only a caller of the backend itself sees the difference.
    PERMIT_RETRY_KEEPS_ENTRY = "permit_retry_keeps_entry"


#: What :meth:`Backend.renew_many` answers for one lease: what :meth:`Backend.renew`
#: would have returned or raised.
RenewResult = Grant | BackendError | NotOwnerError


class RenewedAsAsked(Sequence[RenewResult]):
    """A compact answer of :meth:`Backend.renew_many`: every renewal granted as asked,
    except the few in ``failed``.

    Item ``i`` is ``failed[i]`` if there is one, else ``Grant(token, ttl, sent_at)``
    with the token and ttl of ``renewals[i]`` (made when read): the same answers as a
    list would hold, so any caller can read it as a sequence. The core's scheduler reads
    it without making a :class:`Grant` per lease: a batch of N leases renewed as asked
    then costs it no object per lease. ``renewals`` must not change after it is made.

    :param renewals: the renewals asked, in order
    :param sent_at: the :attr:`Grant.sent_at` of every grant (``None``: the core's own
        send time)
    :param failed: the index of each renewal that was not granted, and what
        :meth:`Backend.renew` would have raised for it
    """

    __slots__ = ("failed", "renewals", "sent_at")

    def __init__(
        self,
        renewals: Sequence[Renewal],
        sent_at: float | None = None,
        failed: Mapping[int, BackendError | NotOwnerError] | None = None,
    ) -> None:
        self.renewals = renewals
        self.sent_at = sent_at
        self.failed: Mapping[int, BackendError | NotOwnerError] = failed or {}

    def __len__(self) -> int:
        return len(self.renewals)

    @overload
    def __getitem__(self, index: int) -> RenewResult: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[RenewResult]: ...

    def __getitem__(self, index: int | slice) -> RenewResult | Sequence[RenewResult]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self.renewals)))]
        _, _, token, ttl = self.renewals[index]  # raises IndexError past the end
        if index < 0:
            index += len(self.renewals)
        failure = self.failed.get(index)
        return Grant(token, ttl, sent_at=self.sent_at) if failure is None else failure

    def __repr__(self) -> str:
        return f"<RenewedAsAsked {len(self.renewals)} renewals, {len(self.failed)} failed>"


async def _end_leases(backend: Backend) -> None:
    from ._life import end_leases  # the core imports this module: not at import time

    await end_leases(backend)


def _ending_leases_first(
    close: Callable[[Backend], Coroutine[Any, Any, None]],
) -> Callable[[Backend], Coroutine[Any, Any, None]]:
    """``close``, after the leases still held through the backend were ended and released."""

    @functools.wraps(close)
    async def aclose(self: Backend) -> None:
        await _end_leases(self)
        await close(self)

    return aclose


class Backend(abc.ABC):
    """A coordination backend. Subclass this to add one.

    Instances are async context managers; :meth:`aclose` releases the leases still
    held through the backend, then closes only what the backend opened itself (never
    a client the user passed in).
    """

    #: ``True`` when the driver runs only on asyncio (the core bridges it under trio).
    requires_asyncio: ClassVar[bool] = False
    #: How long :meth:`wait_changed` sleeps by default when it knows nothing better.
    poll_interval: float = 0.1

    @property
    def capabilities(self) -> frozenset[Capability]:
        """What this instance guarantees beyond the contract, in the mode it was opened
        in. This default: none. A backend overrides it with a class attribute
        (``capabilities = frozenset({...})``) when its mode changes nothing, else with
        a property (``fair=true`` adds :attr:`Capability.FAIR_QUEUE`, say)."""
        return frozenset()

    @property
    def renews_many(self) -> bool:
        """Whether :meth:`renew_many` renews many leases for about the cost of one (one
        round trip, one statement): whether the class overrides it. The core's
        scheduler then hands it every lease due at once, from one task, instead of a
        :meth:`renew` call (and a task) per lease."""
        return type(self).renew_many is not Backend.renew_many

    @functools.cached_property
    def events(self) -> Events:
        """The observers of the leases held through this backend object
        (:class:`~aiolease.Observer`): ``backend.events.subscribe(observer)``. A wrapper
        (the trio bridge, :class:`~aiolease.testing.faults.FaultyBackend`) shares the
        registry of the backend it wraps. Made on first use (a subclass need not call
        an ``__init__`` of the base)."""
        return Events()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Wrap what the subclass defines: its contract methods with the argument
        checks (:mod:`aiolease._checked`), its ``aclose`` with the ending of the
        leases still held (:mod:`aiolease._life`)."""
        super().__init_subclass__(**kwargs)
        install(cls)
        close = cls.__dict__.get("aclose")
        if close is not None:
            # setattr: a method replaced on the class, which mypy would not type.
            setattr(cls, "aclose", _ending_leases_first(close))  # noqa: B010

    @classmethod
    @abc.abstractmethod
    async def from_url(cls, url: str, **options: Any) -> Self:
        """Connect to the backend that ``url`` names.

        :raises InvalidArgument: the URL or an option is malformed
        :raises BackendUnavailable: the server cannot be reached
        """

    @abc.abstractmethod
    async def try_acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
    ) -> Grant | HolderInfo:
        """Grant ``name`` to ``owner`` if it is free, expired, or already ``owner``'s.

        :returns: a :class:`Grant` on success, else the current holder
        :raises BackendError: the outcome is unknown; the caller releases with
            the same ``owner`` to be safe
        """

    @abc.abstractmethod
    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        """Reset the server-side expiry of ``owner``'s grant to now + ``ttl``.

        Resets, never adds. A record the server has expired is not revived.

        :raises NotOwnerError: ``owner`` does not hold ``name`` (any more)
        """

    async def renew_many(self, renewals: Sequence[Renewal]) -> Sequence[RenewResult]:
        """Renew each ``(name, owner, token, ttl)`` as :meth:`renew` would, in one call.

        Used by the core only when :attr:`renews_many` is set. This default renews
        them one after the other.

        :returns: for each renewal, in order, its :class:`Grant` or the error that
            :meth:`renew` would have raised (:class:`NotOwnerError` included); a
            :class:`RenewedAsAsked` says the same for less when most were granted as
            asked
        :raises BackendError: every renewal failed alike (the call as a whole)
        """
        results: list[RenewResult] = []
        for name, owner, token, ttl in renewals:
            try:
                results.append(await self.renew(name, owner, token, ttl))
            except (BackendError, NotOwnerError) as exc:
                results.append(exc)
        return results

    @abc.abstractmethod
    async def release(self, name: str, owner: str, token: int | None) -> bool:
        """Free ``name`` if ``owner`` holds it, and wake waiters.

        ``token`` is ``None`` when the grant's reply was never seen (a compensating
        release after a cancelled acquire); the owner id is unique per attempt, so
        it alone identifies the grant.

        For a permit owner (:attr:`Capability.SEMAPHORE`), this frees its permit (of
        ``token``, if given) and drops its queue entry whatever ``token`` is: a queue
        entry has no token, and a request that gave up leaves no entry to block the
        requests behind it. Dropping a queue entry frees nothing (``False``).

        :returns: whether this call freed it
        """

    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        """Replace the metadata of ``owner``'s grant ``token`` of ``name`` with ``metadata``
        (:attr:`Capability.PROCLAIM`), in one atomic step.

        The grant stays as it is otherwise: same owner, identity and token, and the same
        server-side expiry (this is no renewal). :meth:`read`, and a refused
        :meth:`try_acquire`, report the new metadata from then on, and :meth:`wait_changed`
        waiters return as for any change of the record (push backends wake them). This
        default raises :class:`UnsupportedCapability`.

        :raises NotOwnerError: ``owner`` does not hold ``name`` (any more); nothing
            changed. As for :meth:`renew`, the owner id (unique per acquire attempt)
            names the grant; a backend may check ``token`` too (Redlock cannot: its
            instances count tokens of their own)
        :raises UnsupportedCapability: the backend cannot change metadata in place
        """
        raise UnsupportedCapability(
            f"{self!r} cannot update a grant's metadata in place (no Capability.PROCLAIM)"
        )

    def release_now(self, name: str, owner: str, token: int) -> Awaitable[bool] | None:
        """Send the release of ``owner``'s grant ``token`` of ``name`` before returning,
        if this backend can: an awaitable of what :meth:`release` would return, which
        the core awaits (and only then) as it would the call to :meth:`release`.

        The core calls this when a block that held the lease ends, before its own
        bookkeeping, which then overlaps the round trip: a waiter served by the
        release gets the lease sooner. A plain synchronous call, which must never
        raise. This default returns ``None``: the core calls :meth:`release`.
        """
        return None

    @abc.abstractmethod
    async def read(self, name: str) -> HolderInfo | None:
        """Return the live holder of ``name``, or ``None`` if it is free or expired."""

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        """Return when the record of ``name`` may differ from ``seen``.

        May return early (callers re-read). This default returns at once if the
        record already differs from ``seen``; otherwise it sleeps until the
        current holder's ttl runs out, or :attr:`poll_interval` when that is
        unknown. Backends with push notifications override it.
        """
        current = await self.read(name)
        if state_of(current) != state_of(seen):
            return
        if current is not None and current.remaining is not None:
            await anyio.sleep(max(current.remaining, 0.001))
        else:
            await anyio.sleep(self.poll_interval)

    async def wait_taken(self, name: str, held: HolderInfo) -> None:
        """Return when the server may have released ``name`` or granted it to anyone
        else, while ``held`` (the caller's own grant, from the grant or a read) holds it.

        The core's takeover watch task (a :attr:`Capability.PUSH_WAKEUP` backend whose
        :meth:`on_taken` declined) waits on this, then reads ``name`` to see whether the
        grant is gone. May return early. This default is :meth:`on_taken`'s callback
        when it subscribes now, else :meth:`wait_changed` (which may also return when
        ``held``'s server-side ttl, as last read, runs out: a read per ttl). A backend
        overrides it only when it can wait for its push notifications without a
        subscription of :meth:`on_taken`'s kind (no read and no timer: the holder's
        renewals confirm its ownership every renew interval).
        """
        taken = anyio.Event()
        unsubscribe = self.on_taken(name, held.owner, held.token, lambda _: taken.set())
        if unsubscribe is None:
            await self.wait_changed(name, held)
            return
        try:
            await taken.wait()
        finally:
            unsubscribe()

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Wait, as the refused acquirer ``owner``, until trying again may succeed.

        The core calls this between two ``try_acquire`` attempts by the same ``owner``
        (``seen`` is the holder the refusal reported, ``ttl`` the ttl asked for), and
        undoes a cancelled wait with ``release(name, owner, None)``. A backend with a
        wait queue (:attr:`Capability.FAIR_QUEUE`) overrides it to wake only the
        waiter whose turn it is; it must return well within ``ttl``, so that the retry
        keeps ``owner``'s place in the queue alive. May return early (callers retry).
        This default is :meth:`wait_changed`.
        """
        await self.wait_changed(name, seen)

    async def try_acquire_permit(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        """Grant ``owner`` a permit of ``weight`` out of ``name``'s ``limit``, or refuse
        and queue it (:attr:`Capability.SEMAPHORE`; rules in
        ``docs/internals/semaphores.md``).

        Granted iff the weight of the live permits, plus that of the live queue entries
        that arrived before ``owner``'s, plus ``weight``, is at most ``limit``; a refused
        request enqueues ``owner`` (or refreshes its entry) for ``ttl`` (a backend
        without :attr:`Capability.FAIR_PERMITS` sets a writer-waiting marker instead,
        for ``weight == limit``). A retry by the live holder returns its grant and
        resets its expiry. Tokens come from one counter per name shared by all its
        permits. Afterwards :meth:`renew`, :meth:`renew_many`, :meth:`release` (which
        also drops a queue entry), :meth:`release_now`, :meth:`on_taken`, :meth:`hold`
        and :meth:`wait_lost` serve the permit: its ``owner`` is a permit's
        (:func:`is_permit_owner`).

        :returns: the :class:`Grant`, or the holder that blocks the request (the live
            permit that expires first; when only the queue blocks, the first entry
            ahead, with token 0)
        :raises LimitMismatchError: ``name`` has live permits or queue entries asked
            with another limit; nothing changed
        :raises UnsupportedCapability: this default (no :attr:`Capability.SEMAPHORE`)
        """
        raise UnsupportedCapability(f"{self!r} does not serve semaphores")

    async def read_permits(self, name: str) -> PermitHolders | None:
        """The live permits of ``name`` and how many requests are queued, or ``None``
        when it has neither.

        :raises UnsupportedCapability: this default (no :attr:`Capability.SEMAPHORE`)
        """
        raise UnsupportedCapability(f"{self!r} does not serve semaphores")

    @returns_within_ttl
    async def wait_permit_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Wait, as the refused permit request ``owner``, until trying again may
        succeed: :meth:`wait_turn` for permits (``seen`` is what the refusal reported).
        Must return well within ``ttl``, so that the retry keeps ``owner``'s queue entry
        alive. May return early. This default sleeps :attr:`poll_interval` (less if
        ``seen`` expires sooner, never more than a third of ``ttl``)."""
        delay = min(self.poll_interval, ttl / 3)
        if seen.remaining is not None:
            delay = min(delay, max(seen.remaining, 0.001))
        await anyio.sleep(delay)

    async def wait_lost(self, name: str, owner: str, token: int) -> LossReason:
        """Return when this backend knows that ``owner``'s grant ``token`` of ``name`` has
        ended, and why.

        For session backends (:attr:`Capability.SESSION`): while a lease is held, the
        core waits on this and ends the lease with the reason returned, without
        waiting for its next renewal. Such a backend returns when the session the
        grant rides on is lost (:attr:`LossReason.STOLEN` if the server dropped it,
        ``UNREACHABLE`` or ``EXPIRED`` if it could not be kept alive), and
        :attr:`LossReason.SHUTDOWN` when the backend is closed, *before* it lets the
        server drop the grant. It is the awaited form of :meth:`hold`'s ``ended``, for
        a backend that cannot keep grants itself (a client of a backend served over
        the wire): the core waits on it only when :meth:`hold` returned ``None``. This
        default never returns.
        """
        await anyio.sleep_forever()
        raise AssertionError("unreachable")  # pragma: no cover

    def hold(
        self, name: str, owner: str, token: int, ended: Callable[[LossReason], object]
    ) -> SessionClock | None:
        """Take over keeping ``owner``'s grant ``token`` of ``name`` alive, for the core.

        The core calls this once when it starts holding a lease, where the backend's
        class overrides this default (which it does not call). A session backend
        whose :meth:`renew` is only local bookkeeping returns the clock of the session
        the grant rides on; the core then never calls :meth:`renew` for that lease, and
        its local deadline is ``clock.expires - margin``. From then until
        :meth:`release` of the grant, the backend keeps the grant for as long as the
        session lives (a grant nobody holds still lapses after its ttl), and calls
        ``ended(reason)`` (a plain function that only records; from any task of the
        backend) as soon as it knows the grant is gone, with the reasons of
        :meth:`wait_lost`, a takeover of the grant on the server (``STOLEN``) included:
        the core then runs no takeover watch (:meth:`on_taken`) for the lease. It must
        be a plain synchronous call: the core calls it through the trio bridge too.

        This default returns ``None``: the core renews the lease itself.

        :raises NotOwnerError: the grant is not held through this backend (any more)
        """
        return None

    def on_taken(
        self, name: str, owner: str, token: int, taken: Callable[[LossReason], object]
    ) -> Callable[[], None] | None:
        """Call ``taken(LossReason.STOLEN)`` as soon as this backend learns that
        ``owner``'s grant ``token`` of ``name`` is gone (released by someone else, or
        granted to another), until the returned function is called.

        The core calls this once when it starts holding a lease on a
        :attr:`Capability.PUSH_WAKEUP` backend whose :meth:`hold` returned ``None``;
        when it returns a function, the core runs no takeover watch task
        (:meth:`wait_taken`) for that lease. ``taken`` is a
        plain function that only records (call it from any task of the backend; the
        core ignores a call after the lease ended). Like :meth:`hold`, this must be a
        plain synchronous call. This default returns ``None``: the core watches with
        :meth:`wait_taken` in a task of its own.
        """
        return None

    async def aclose(self) -> None:
        """Close what this backend opened. Idempotent.

        Every subclass's ``aclose`` first ends the leases still held through the
        backend (:attr:`LossReason.SHUTDOWN`) and releases them, bounded in time and
        shielded (the core wraps it); an override only closes its own resources.
        """
        await _end_leases(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


install(Backend)  # its own defaults too


class ForwardingBackend(Backend):
    """A backend that hands every operation of the contract to another one, near or far:
    the base of wrappers (:class:`WrappingBackend`) and of wire clients
    (:class:`~aiolease.testing.remote.RemoteBackend`).

    Every awaited operation of :class:`Backend` goes through :meth:`_forward`, every
    plain synchronous hook (:meth:`release_now`, :meth:`hold`, :meth:`on_taken`)
    through :meth:`_forward_now`; a subclass says how calls travel by defining those
    two, and what the other side guarantees (:attr:`capabilities`,
    :attr:`renews_many`, :attr:`poll_interval`). A test
    (``tests/testing/test_forwarding.py``) checks that nothing is left out.
    """

    @abc.abstractmethod
    async def _forward(self, op: str, *args: Any) -> Any:
        """Run the awaited operation ``op`` (a method name of :class:`Backend`) with
        ``args`` on the other side, and return its result."""

    def _forward_now(self, op: str, *args: Any) -> Any:
        """Make the plain synchronous call ``op`` on the other side. This default
        returns ``None`` (what the base's hooks answer: the core then releases,
        renews and watches by awaited operations), for a side that cannot be reached
        without awaiting."""
        return None

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> Self:
        """:raises InvalidArgument: always, unless a subclass is opened from URLs"""
        raise InvalidArgument(f"{cls.__name__} is not opened from a URL")

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        outcome: Grant | HolderInfo = await self._forward(
            "try_acquire", name, owner, ttl, identity, metadata
        )
        return outcome

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        grant: Grant = await self._forward("renew", name, owner, token, ttl)
        return grant

    async def renew_many(self, renewals: Sequence[Renewal]) -> Sequence[RenewResult]:
        results: Sequence[RenewResult] = await self._forward("renew_many", renewals)
        return results

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        freed: bool = await self._forward("release", name, owner, token)
        return freed

    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        await self._forward("update_metadata", name, owner, token, metadata)

    def release_now(self, name: str, owner: str, token: int) -> Awaitable[bool] | None:
        sent: Awaitable[bool] | None = self._forward_now("release_now", name, owner, token)
        return sent

    async def read(self, name: str) -> HolderInfo | None:
        holder: HolderInfo | None = await self._forward("read", name)
        return holder

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        await self._forward("wait_changed", name, seen)

    async def wait_taken(self, name: str, held: HolderInfo) -> None:
        await self._forward("wait_taken", name, held)

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        await self._forward("wait_turn", name, owner, ttl, seen)

    async def try_acquire_permit(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        outcome: Grant | HolderInfo = await self._forward(
            "try_acquire_permit", name, owner, ttl, identity, metadata, limit, weight
        )
        return outcome

    async def read_permits(self, name: str) -> PermitHolders | None:
        permits: PermitHolders | None = await self._forward("read_permits", name)
        return permits

    async def wait_permit_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        await self._forward("wait_permit_turn", name, owner, ttl, seen)

    async def wait_lost(self, name: str, owner: str, token: int) -> LossReason:
        reason: LossReason = await self._forward("wait_lost", name, owner, token)
        return reason

    def hold(
        self, name: str, owner: str, token: int, ended: Callable[[LossReason], object]
    ) -> SessionClock | None:
        clock: SessionClock | None = self._forward_now("hold", name, owner, token, ended)
        return clock

    def on_taken(
        self, name: str, owner: str, token: int, taken: Callable[[LossReason], object]
    ) -> Callable[[], None] | None:
        unsubscribe: Callable[[], None] | None = self._forward_now(
            "on_taken", name, owner, token, taken
        )
        return unsubscribe


class WrappingBackend(ForwardingBackend):
    """A :class:`ForwardingBackend` around a backend of this process, ``inner``: the
    base of the trio bridge and of :class:`~aiolease.testing.faults.FaultyBackend`.

    Every operation, hook and property of the contract is ``inner``'s unless a
    subclass changes how it travels. Leases acquired through the wrapper are ended
    when the wrapper is closed, those acquired through ``inner`` when ``inner`` is:
    closing the wrapper closes ``inner``.

    :param inner: the backend that does the work
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.poll_interval = inner.poll_interval

    def __repr__(self) -> str:
        return f"<{type(self).__name__} over {self.inner!r}>"

    @property
    def capabilities(self) -> frozenset[Capability]:
        """``inner``'s."""
        return self.inner.capabilities

    @functools.cached_property
    def events(self) -> Events:
        """``inner``'s: an observer sees the leases held through either."""
        return self.inner.events

    @property
    def renews_many(self) -> bool:
        """``inner``'s."""
        return self.inner.renews_many

    async def _forward(self, op: str, *args: Any) -> Any:
        """Await ``inner``'s ``op``."""
        return await getattr(self.inner, op)(*args)

    def _forward_now(self, op: str, *args: Any) -> Any:
        """Call ``inner``'s ``op``."""
        return getattr(self.inner, op)(*args)

    async def aclose(self) -> None:
        """Close ``inner`` (which ends the leases acquired through it)."""
        await self.inner.aclose()
