"""AsyncSemaphore and AsyncReadWriteLock: permits that are leases of their own.

Both are one mechanism (``docs/internals/semaphores.md``): a permit of some *weight*
out of a name's *limit*, granted in arrival order where the backend queues. A
semaphore of limit N asks for weight 1; a read-write lock is the limit
:data:`~aiolease._permits.RW_LIMIT`, a reader weighing 1 and a writer all of it.
Each permit is a :class:`~aiolease.Lease` acquired by the lock's acquire loop and
guarded by the lock's :class:`~aiolease._holding.Holding` (renewal by the backend's
one renewer, cancel-on-loss, release), so only what differs lives here.
"""

from __future__ import annotations

from collections.abc import Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, final

import anyio

from ._acquire import acquire_lease, checked_default_identity, validate_backend
from ._exceptions import LossReason, UnsupportedCapability
from ._holding import Counters
from ._lease import Lease, Timing
from ._lock import _Acquisition, _Blocks, _timing
from ._permits import MAX_LIMIT, RW_LIMIT, PermitRequest, check_limit
from ._validate import check_identity, check_metadata, check_name, check_seconds
from .abc import Backend, Capability

__all__ = [
    "AsyncReadWriteLock",
    "AsyncSemaphore",
    "ReadWriteLockStatistics",
    "ReadWriteMode",
    "SemaphoreStatistics",
]

_NO_METADATA: Mapping[str, str] = MappingProxyType({})


@final
@dataclass(frozen=True)
class SemaphoreStatistics:
    """A snapshot of one :class:`AsyncSemaphore`'s activity in this process.

    :param name: the semaphore's name
    :param limit: its limit
    :param held: how many of its permits are held in blocks right now
    :param acquisitions: confirmed grants
    :param renewals: confirmed renewals
    :param renew_failures: renewals that failed and were retried
    :param losses: permits lost, by reason
    """

    name: str
    limit: int
    held: int
    acquisitions: int
    renewals: int
    renew_failures: int
    losses: Mapping[LossReason, int]


@final
@dataclass(frozen=True)
class ReadWriteLockStatistics:
    """A snapshot of one :class:`AsyncReadWriteLock`'s activity in this process.

    :param name: the lock's name
    :param reading: read permits held in blocks right now
    :param writing: write permits held in blocks right now (0 or 1)
    :param acquisitions: confirmed grants, both modes
    :param renewals: confirmed renewals, both modes
    :param renew_failures: renewals that failed and were retried
    :param losses: permits lost, by reason
    """

    name: str
    reading: int
    writing: int
    acquisitions: int
    renewals: int
    renew_failures: int
    losses: Mapping[LossReason, int]


class _Settings:
    """What every permit of one primitive is acquired with (validated once)."""

    __slots__ = ("backend", "counters", "identity", "metadata", "name", "timing")

    def __init__(
        self,
        backend: object,
        name: object,
        ttl: object,
        renew_interval: object,
        margin: object,
        identity: object,
        metadata: object,
        release_timeout: object,
        what: str,
    ) -> None:
        self.backend = validate_backend(backend)
        if Capability.SEMAPHORE not in self.backend.capabilities:
            raise UnsupportedCapability(
                f"{self.backend!r} does not serve {what} (no Capability.SEMAPHORE)"
            )
        self.name = check_name(name)
        self.timing: Timing = _timing(ttl, renew_interval, margin, release_timeout)
        self.identity = checked_default_identity() if identity is None else check_identity(identity)
        self.metadata = (
            _NO_METADATA if metadata is None else MappingProxyType(check_metadata(metadata))
        )
        self.counters = Counters()


class _Permits(_Blocks):
    """The acquire variants of one kind of permit (a semaphore's, a reader's, a writer's):
    the same as :class:`~aiolease.AsyncLock`'s."""

    def __init__(self, settings: _Settings, request: PermitRequest) -> None:
        self._settings = settings
        self._request = request
        self._counters = settings.counters
        self._held = 0

    @property
    def name(self) -> str:
        """The name the permits are of."""
        return self._settings.name

    @property
    def timing(self) -> Timing:
        """The validated timing (ttl, renew interval, margin, release timeout)."""
        return self._settings.timing

    async def acquire(self, *, timeout: float | None = None) -> Lease:
        """Wait until a permit is granted (first come, first served where the backend
        queues, :attr:`Capability.FAIR_PERMITS <aiolease.abc.Capability.FAIR_PERMITS>`).

        The returned lease is not renewed in the background: use ``async with`` for
        that, or call :meth:`Lease.renew` yourself before :attr:`Lease.deadline`, and
        :meth:`Lease.release` when done.

        :param timeout: give up after this many seconds; ``0`` is :meth:`acquire_nowait`:
            one try, no wait, and :class:`LeaseHeldError` if no permit is free
        :raises TimeoutError: ``timeout`` (not ``0``) ran out; nothing is held or queued
        :raises LeaseHeldError: ``timeout`` is ``0`` and no permit is free
        :raises LimitMismatchError: the name's permits are held with another limit
        :raises BackendError: the backend failed; nothing is held
        """
        if timeout is None:
            return await self._acquire(blocking=True)
        seconds = check_seconds("timeout", timeout, allow_zero=True)
        if seconds == 0:  # one try, as acquire_nowait() (and as AsyncLock.acquire)
            return await self._acquire(blocking=False)
        with anyio.fail_after(seconds):
            return await self._acquire(blocking=True)

    async def acquire_nowait(self) -> Lease:
        """Try once.

        :raises LeaseHeldError: no permit is free (``.holder`` is one that blocks)
        :raises LimitMismatchError: the name's permits are held with another limit
        :raises BackendError: the backend failed; nothing is held
        """
        return await self._acquire(blocking=False)

    def _acquire(self, *, blocking: bool) -> Coroutine[Any, Any, Lease]:
        """The acquire loop's coroutine, to be awaited (as :class:`AsyncLock`'s)."""
        s = self._settings
        return acquire_lease(
            s.backend,
            s.name,
            s.timing,
            s.identity,
            s.metadata,
            s.counters,
            blocking=blocking,
            permit=self._request,
        )

    def hold(self, *, timeout: float | None = None) -> AbstractAsyncContextManager[Lease]:
        """``async with x.hold(timeout=5) as permit:``: ``async with x`` with a timeout."""
        if timeout is not None:
            check_seconds("timeout", timeout, allow_zero=True)
        return _Acquisition(self, timeout)


@final
class AsyncSemaphore(_Permits):
    """At most ``limit`` holders of ``name`` at once, each permit a lease of its own.

    ``async with sem as permit:`` waits for a permit, renews it in the background,
    cancels the block if it is lost (then raises :class:`LeaseLostError`), and
    releases it on exit; ``permit.token`` strictly increases per name across all its
    permits. Expiry is judged on the backend's clock: a crashed holder's permit is
    back at its expiry. Every client of one name must give the same ``limit``
    (otherwise :class:`LimitMismatchError`). A task may hold several permits.

    :param backend: where the permits live (:attr:`Capability.SEMAPHORE
        <aiolease.abc.Capability.SEMAPHORE>`)
    :param name: the name: non-empty, at most 255 UTF-8 bytes, no NUL
    :param limit: how many permits may be held at once (an int from 1 to 1,000,000)
    :param ttl: seconds the backend keeps a permit without a renewal
    :param renew_interval: as for :class:`AsyncLock`
    :param margin: as for :class:`AsyncLock`
    :param identity: who holds it, for humans (default ``host:pid``)
    :param metadata: a small ``str -> str`` map published with each permit
    :param release_timeout: as for :class:`AsyncLock`
    :raises InvalidArgument: on any bad argument; nothing is sent
    :raises UnsupportedCapability: the backend does not serve semaphores
    """

    def __init__(
        self,
        backend: Backend,
        name: str,
        *,
        limit: int,
        ttl: float,
        renew_interval: float | None = None,
        margin: float | None = None,
        identity: str | None = None,
        metadata: Mapping[str, str] | None = None,
        release_timeout: float | None = None,
    ) -> None:
        settings = _Settings(
            backend,
            name,
            ttl,
            renew_interval,
            margin,
            identity,
            metadata,
            release_timeout,
            "semaphores",
        )
        super().__init__(settings, PermitRequest(check_limit(limit, at_most=MAX_LIMIT), 1))

    def __repr__(self) -> str:
        s = self._settings
        return (
            f"<AsyncSemaphore {s.name!r} limit={self.limit} ttl={s.timing.ttl:g}s on {s.backend!r}>"
        )

    @property
    def limit(self) -> int:
        """How many permits may be held at once."""
        return self._request.limit

    def statistics(self) -> SemaphoreStatistics:
        """A frozen snapshot of this semaphore's counters."""
        c = self._counters
        return SemaphoreStatistics(
            self.name,
            self.limit,
            self._held,
            c.acquisitions,
            c.renewals,
            c.renew_failures,
            dict(c.losses),
        )


@final
class ReadWriteMode(_Permits):
    """The reader or the writer side of an :class:`AsyncReadWriteLock`
    (``rw.read()``, ``rw.write()``): ``async with``, :meth:`acquire`,
    :meth:`acquire_nowait` and :meth:`hold` as for a lock."""

    def __repr__(self) -> str:
        mode = "write" if self._request.weight == RW_LIMIT else "read"
        return f"<ReadWriteMode {mode} of {self._settings.name!r}>"


@final
class AsyncReadWriteLock:
    """Many readers or one writer of ``name`` at once, each a lease of its own.

    ``async with rw.read() as lease:`` shares the name with other readers; ``async
    with rw.write() as lease:`` holds it alone. Where the backend queues
    (:attr:`Capability.FAIR_PERMITS <aiolease.abc.Capability.FAIR_PERMITS>`), readers
    and writers are served in arrival order: a reader that arrives after a waiting
    writer waits, so writers never starve. Tokens strictly increase per name across
    both modes. Each block is renewed, cancelled on loss and released as a lock's.

    A task that holds a read permit and asks for the write permit of the same name
    waits for itself (until its timeout): release the read permit first.

    The parameters are :class:`AsyncSemaphore`'s, without ``limit``.

    :raises InvalidArgument: on any bad argument; nothing is sent
    :raises UnsupportedCapability: the backend does not serve read-write locks
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
    ) -> None:
        settings = _Settings(
            backend,
            name,
            ttl,
            renew_interval,
            margin,
            identity,
            metadata,
            release_timeout,
            "read-write locks",
        )
        self._settings = settings
        self._reader = ReadWriteMode(settings, PermitRequest(RW_LIMIT, 1))
        self._writer = ReadWriteMode(settings, PermitRequest(RW_LIMIT, RW_LIMIT))

    def __repr__(self) -> str:
        s = self._settings
        return f"<AsyncReadWriteLock {s.name!r} ttl={s.timing.ttl:g}s on {s.backend!r}>"

    @property
    def name(self) -> str:
        """The lock's name."""
        return self._settings.name

    @property
    def timing(self) -> Timing:
        """The validated timing (ttl, renew interval, margin, release timeout)."""
        return self._settings.timing

    def read(self) -> ReadWriteMode:
        """The reader side: shares the name with other readers."""
        return self._reader

    def write(self) -> ReadWriteMode:
        """The writer side: holds the name alone."""
        return self._writer

    def statistics(self) -> ReadWriteLockStatistics:
        """A frozen snapshot of this lock's counters (both modes)."""
        c = self._settings.counters
        return ReadWriteLockStatistics(
            self.name,
            self._reader._held,
            self._writer._held,
            c.acquisitions,
            c.renewals,
            c.renew_failures,
            dict(c.losses),
        )
