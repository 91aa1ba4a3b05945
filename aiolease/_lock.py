"""AsyncLock: a distributed lock whose protected block is cancelled if the lease is lost."""

from __future__ import annotations

from collections.abc import Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Protocol, final

import anyio

from ._acquire import acquire_lease, checked_default_identity, validate_backend
from ._bridge import adapt
from ._clock import cancel_scope
from ._exceptions import LossReason, UnsupportedCapability
from ._holding import Counters, Holding
from ._lease import Lease, Timing
from ._limits import HoldLimits
from ._validate import check_identity, check_metadata, check_name, check_seconds
from .abc import Backend, Capability, HolderInfo

#: Validated timings by their arguments (with their types: ``True`` is not ``1``).
_timings: dict[tuple[object, ...], Timing] = {}
_NO_METADATA: Mapping[str, str] = MappingProxyType({})


def _timing(ttl: object, renew_interval: object, margin: object, release_timeout: object) -> Timing:
    """``Timing._build``, remembered for the arguments seen before (a lock is often made
    per use, with the same few timings)."""
    args = (ttl, renew_interval, margin, release_timeout)
    key = (*args, *map(type, args))
    try:
        timing = _timings.get(key)
    except TypeError:  # unhashable: Timing._build says what is wrong with it
        return Timing._build(*args)
    if timing is None:
        timing = Timing._build(*args)
        if len(_timings) < 256:
            _timings[key] = timing
    return timing


@final
@dataclass(frozen=True)
class LockStatistics:
    """A snapshot of one :class:`AsyncLock`'s activity in this process.

    :param name: the lease name
    :param held: how many of this lock's leases are held right now
    :param acquisitions: confirmed grants
    :param renewals: confirmed renewals
    :param renew_failures: renewals that failed and were retried
    :param losses: leases lost, by reason
    """

    name: str
    held: int
    acquisitions: int
    renewals: int
    renew_failures: int
    losses: Mapping[LossReason, int]


#: The ``async with lock:`` blocks open in the current task, innermost last.
_open: ContextVar[tuple[_Acquisition, ...]] = ContextVar("aiolease_open_locks", default=())


class _Acquirer(Protocol):
    """What :class:`_Acquisition` needs of what it acquires: a lock, or a permit kind
    (:mod:`aiolease._semaphore`)."""

    _counters: Counters
    _held: int

    async def acquire(self, *, timeout: float | None = None) -> Lease: ...

    def _acquire(self, *, blocking: bool) -> Coroutine[Any, Any, Lease]: ...


class _Acquisition(AbstractAsyncContextManager[Lease]):
    """One ``async with lock.hold():`` block (and one ``async with lock:`` block, which
    ``opened`` pushes on the task's :data:`_open` blocks once it holds the lease)."""

    __slots__ = ("_holding", "_lock", "_opened", "_timeout")

    def __init__(self, lock: _Acquirer, timeout: float | None, opened: bool = False) -> None:
        self._lock = lock
        self._timeout = timeout
        self._opened = opened
        self._holding: Holding | None = None

    async def __aenter__(self) -> Lease:
        body = cancel_scope()  # made now: less to do between the grant and the body
        lock = self._lock
        if self._timeout is None:
            lease = await lock._acquire(blocking=True)  # (acquire(), one call less)
        else:
            lease = await lock.acquire(timeout=self._timeout)
        holding = self._holding = Holding(lease, lock._counters, body=body)
        lock._held += 1
        try:
            await holding.__aenter__()
        except BaseException:
            lock._held -= 1
            raise
        if self._opened:
            _open.set((*_open.get(), self))
        return lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        assert self._holding is not None
        try:
            return await self._holding.__aexit__(exc_type, exc, tb)
        finally:
            self._lock._held -= 1


class _Blocks:
    """``async with x:`` for a lock or a permit kind: each enter paired with its exit
    per task (a context variable is per task, and cheaper to read than the task's
    id), so one object serves many tasks.

    ``__aenter__`` and ``__aexit__`` are plain functions that return the block's own
    coroutines: one coroutine less to run through on every step of the block's
    acquire and release."""

    _counters: Counters
    _held: int

    if TYPE_CHECKING:  # defined by each subclass, with its own documentation

        async def acquire(self, *, timeout: float | None = None) -> Lease: ...

        def _acquire(self, *, blocking: bool) -> Coroutine[Any, Any, Lease]: ...

    def __aenter__(self) -> Coroutine[Any, Any, Lease]:
        return _Acquisition(self, None, opened=True).__aenter__()

    def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Coroutine[Any, Any, bool]:
        stack = _open.get()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i]._lock is self:
                context = stack[i]
                _open.set(stack[:i] + stack[i + 1 :])
                return context.__aexit__(exc_type, exc, tb)
        raise RuntimeError(f"{self!r}: __aexit__ without __aenter__ in this task")


@final
class AsyncLock(_Blocks):
    """A distributed lock with auto-renewal, fencing tokens and cancel-on-loss.

    ``async with lock as lease:`` acquires (waiting as long as it takes), renews
    in the background, cancels the block if the lease is lost (then raises
    :class:`LeaseLostError`), and releases on exit. One lock object may be used
    by many tasks at once; each ``async with`` is its own grant. Locks are not
    reentrant: inside ``async with lock``, waiting for the same name through the same
    backend object in the same task raises :class:`ReentrantAcquireError` at once
    (``acquire_nowait()`` reports the holder, as for any other).

    :param backend: where the lease lives
    :param name: the lease name: non-empty, at most 255 UTF-8 bytes, no NUL
    :param ttl: seconds the backend keeps the lease without a renewal
    :param renew_interval: seconds between renewals (default ``ttl / 3``)
    :param margin: seconds the holder stops before the server could expire it
        (default ``max(0.1 * ttl, 0.05)``)
    :param identity: who holds it, for humans (default ``host:pid``)
    :param metadata: a small ``str -> str`` map published with the grant
    :param release_timeout: upper bound on a release (default ``min(max(ttl, 1), 10)``);
        a lease lost at its deadline or taken is released for at most ``margin``
    :param max_hold: seconds (or a :class:`~datetime.timedelta`) after which a lease is
        not renewed any more: the block is cancelled, raises :class:`LeaseLostError`
        with :attr:`LossReason.MAX_HOLD`, and the lease is released
    :param min_hold: seconds (or a :class:`~datetime.timedelta`) the name stays taken
        after a grant, even if released sooner (ShedLock's ``lockAtLeastFor``): a release
        before then leaves the grant on the server until then
    :raises InvalidArgument: on any bad argument; nothing is sent
    :raises UnsupportedCapability: the backend serves leader election only
        (:attr:`Capability.ELECTION_ONLY <aiolease.abc.Capability.ELECTION_ONLY>`), or
        ``min_hold`` on a session backend
        (:attr:`Capability.SESSION <aiolease.abc.Capability.SESSION>`)
    """

    def __init__(
        self,
        backend: Backend,
        name: str,
        *,
        ttl: float,
        renew_interval: float | None = None,
        margin: float | None = None,
        identity: str | None = None,
        metadata: Mapping[str, str] | None = None,
        release_timeout: float | None = None,
        max_hold: float | timedelta | None = None,
        min_hold: float | timedelta | None = None,
    ) -> None:
        self._backend = validate_backend(backend)
        if Capability.ELECTION_ONLY in backend.capabilities:
            raise UnsupportedCapability(
                f"{backend!r} serves leader election only (Capability.ELECTION_ONLY):"
                " use aiolease.Elector"
            )
        self._name = check_name(name)
        self._timing = _timing(ttl, renew_interval, margin, release_timeout)
        self._identity = (
            checked_default_identity() if identity is None else check_identity(identity)
        )
        self._metadata = (
            _NO_METADATA if metadata is None else MappingProxyType(check_metadata(metadata))
        )
        self._limits = HoldLimits.build(backend, max_hold, min_hold)
        self._counters = Counters()
        self._held = 0

    def __repr__(self) -> str:
        return f"<AsyncLock {self._name!r} ttl={self._timing.ttl:g}s on {self._backend!r}>"

    @property
    def name(self) -> str:
        """The lease name."""
        return self._name

    @property
    def timing(self) -> Timing:
        """The validated timing (ttl, renew interval, margin, release timeout)."""
        return self._timing

    async def acquire(self, *, timeout: float | None = None) -> Lease:
        """Wait until the lease is granted.

        The returned lease is not renewed in the background: use ``async with``
        for that, or call :meth:`Lease.renew` yourself before :attr:`Lease.deadline`,
        and :meth:`Lease.release` when done. Enclosing cancel scopes apply too.

        :param timeout: give up after this many seconds; ``0`` is :meth:`acquire_nowait`:
            one try, no wait, and :class:`LeaseHeldError` (with the holder) if taken
        :raises TimeoutError: ``timeout`` (not ``0``) ran out; nothing is held
        :raises LeaseHeldError: ``timeout`` is ``0`` and somebody else (or this task)
            holds it
        :raises ReentrantAcquireError: this task holds the name in a block already, and
            ``timeout`` is not ``0``
        :raises BackendError: the backend failed; nothing is held
        """
        if timeout is None:
            return await self._acquire(blocking=True)
        seconds = check_seconds("timeout", timeout, allow_zero=True)
        if seconds == 0:
            # A deadline of "now" would cancel the first request before it is sent:
            # zero means one try, as in "only if it is free right now".
            return await self._acquire(blocking=False)
        with anyio.fail_after(seconds):
            return await self._acquire(blocking=True)

    async def holder(self) -> HolderInfo | None:
        """Who holds the name now, in one read of the backend (``None``: nobody).

        The :class:`HolderInfo` carries the holder's identity, fencing token and
        metadata, and the server-side ttl it had left when read, where the backend
        knows it. A snapshot: it may change as soon as it is returned.

        :raises BackendError: the read failed
        """
        return await adapt(self._backend).read(self._name)

    async def acquire_nowait(self) -> Lease:
        """Try once.

        :raises LeaseHeldError: somebody else holds it (``.holder`` says who), or this
            task does
        :raises BackendError: the backend failed; nothing is held
        """
        return await self._acquire(blocking=False)

    def _acquire(self, *, blocking: bool) -> Coroutine[Any, Any, Lease]:
        """The acquire loop's coroutine, to be awaited (this is not a coroutine of its
        own: one less to run through on every step of a contended acquire)."""
        acquiring = acquire_lease(
            self._backend,
            self._name,
            self._timing,
            self._identity,
            self._metadata,
            self._counters,
            blocking=blocking,
        )
        return acquiring if self._limits is None else self._limited(acquiring)

    async def _limited(self, acquiring: Coroutine[Any, Any, Lease]) -> Lease:
        """The lease ``acquiring`` grants, with this lock's ``max_hold`` / ``min_hold``."""
        lease = await acquiring
        assert self._limits is not None
        return self._limits.apply(lease)

    def hold(self, *, timeout: float | None = None) -> AbstractAsyncContextManager[Lease]:
        """``async with lock.hold(timeout=5) as lease:``: ``async with lock`` with a timeout
        (``timeout=0``: one try, as :meth:`acquire` takes it)."""
        if timeout is not None:
            check_seconds("timeout", timeout, allow_zero=True)
        return _Acquisition(self, timeout)

    def statistics(self) -> LockStatistics:
        """A frozen snapshot of this lock's counters."""
        c = self._counters
        return LockStatistics(
            self._name, self._held, c.acquisitions, c.renewals, c.renew_failures, dict(c.losses)
        )
