"""AsyncLock: a distributed lock whose protected block is cancelled if the lease is lost."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import final

import anyio

from ._bridge import adapt
from ._clock import current_time
from ._exceptions import BackendTimeout, LeaseHeldError, LossReason
from ._keepalive import Counters, Holding
from ._lease import Lease, Timing, release_shielded
from ._life import Tenancy
from ._validate import check_identity, check_metadata, check_name, check_seconds
from .abc import Backend, Capability, Grant

_identity: tuple[int, str] = (-1, "")
#: The default identity once it passed :func:`check_identity`, per process.
_checked_identity: tuple[int, str] = (-1, "")
#: Validated timings by their arguments (with their types: ``True`` is not ``1``).
_timings: dict[tuple[object, ...], Timing] = {}
_NO_METADATA: Mapping[str, str] = MappingProxyType({})


def default_identity() -> str:
    """``host:pid``, what the holder shows when it gives no identity (worked out once
    per process: a lock is often made per use)."""
    global _identity
    pid = os.getpid()
    if _identity[0] != pid:  # first use, or a forked child
        _identity = (pid, f"{socket.gethostname()}:{pid}"[:255])
    return _identity[1]


def _checked_default_identity() -> str:
    """:func:`default_identity`, checked once per process.

    :raises InvalidArgument: the host name makes it more than 255 bytes of UTF-8
    """
    global _checked_identity
    pid = os.getpid()
    if _checked_identity[0] != pid:
        _checked_identity = (pid, check_identity(default_identity()))
    return _checked_identity[1]


def _timing(ttl: object, renew_interval: object, margin: object, release_timeout: object) -> Timing:
    """``Timing.build``, remembered for the arguments seen before (a lock is often made
    per use, with the same few timings)."""
    args = (ttl, renew_interval, margin, release_timeout)
    key = (*args, *map(type, args))
    try:
        timing = _timings.get(key)
    except TypeError:  # unhashable: Timing.build says what is wrong with it
        return Timing.build(*args)
    if timing is None:
        timing = Timing.build(*args)
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


def validate_backend(backend: object) -> Backend:
    """:raises InvalidArgument: ``backend`` is not a :class:`Backend`"""
    if not isinstance(backend, Backend):
        from ._exceptions import InvalidArgument

        raise InvalidArgument(f"backend must be an aiolease Backend, not {type(backend).__name__}")
    return backend


async def acquire_lease(
    backend: Backend,
    name: str,
    timing: Timing,
    identity: str,
    metadata: Mapping[str, str],
    counters: Counters,
    *,
    blocking: bool,
) -> Lease:
    """Campaign for ``name`` until granted (or once, if not ``blocking``).

    A request whose reply may have been lost, or a queue entry left behind by a
    cancelled wait, is undone by a shielded release with the same owner id.

    :raises ReentrantAcquireError: ``blocking``, and the running task holds ``name``
        through ``backend`` in a block already (it would wait for itself); nothing is sent
    :raises LeaseHeldError: not ``blocking`` and somebody else (or this task) holds it
    :raises BackendError: the backend failed; nothing is held
    """
    tenancy = Tenancy.of(backend)
    if blocking:
        tenancy.check_reentry(name)
    backend = adapt(backend)
    owner = os.urandom(16).hex()  # as random as uuid4().hex, for a fifth of the time
    fair = Capability.FAIR_QUEUE in backend.capabilities
    maybe_held = False
    try:
        while True:
            sent_at = current_time()
            maybe_held = True
            result = await backend.try_acquire(name, owner, timing.ttl, identity, metadata)
            if isinstance(result, Grant):
                # A driver may swallow a cancellation that arrived while it awaited the
                # reply (redis-py's asyncio client can): never hand a cancelled caller a lease.
                await anyio.lowlevel.checkpoint_if_cancelled()
                if timing.deadline_after(sent_at, result) > current_time():
                    counters.acquisitions += 1
                    lease: Lease = Lease._create(
                        backend, name, owner, identity, metadata, timing, sent_at, result
                    )
                    tenancy.track(lease)
                    return lease
                # The grant came back too late to be of any use: give it back.
                await release_shielded(backend, name, owner, result.token, timing)
                maybe_held = fair
                if not blocking:
                    raise BackendTimeout(f"grant of {name!r} arrived after its safe deadline")
                continue
            maybe_held = fair
            if not blocking:
                raise LeaseHeldError(name, result)
            # A backend may hand the name to a waiter inside wait_turn (PostgreSQL's
            # hand-off in the release statement): a wait that ends by an exception
            # must give back what it may have been given.
            maybe_held = True
            with anyio.move_on_after(timing.ttl):
                await backend.wait_turn(name, owner, timing.ttl, result)
    except BaseException:
        if maybe_held:
            await release_shielded(backend, name, owner, None, timing)
        raise


#: The ``async with lock:`` blocks open in the current task, innermost last.
_open: ContextVar[tuple[_Acquisition, ...]] = ContextVar("aiolease_open_locks", default=())


class _Acquisition(AbstractAsyncContextManager[Lease]):
    """One ``async with lock.hold():`` block."""

    def __init__(self, lock: AsyncLock, timeout: float | None) -> None:
        self._lock = lock
        self._timeout = timeout
        self._holding: Holding | None = None

    async def __aenter__(self) -> Lease:
        body = anyio.CancelScope()  # made now: less to do between the grant and the body
        lease = await self._lock.acquire(timeout=self._timeout)
        self._holding = Holding(lease, self._lock._counters, body=body)
        self._lock._held += 1
        try:
            return await self._holding.__aenter__()
        except BaseException:
            self._lock._held -= 1
            raise

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


@final
class AsyncLock:
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
    :raises InvalidArgument: on any bad argument; nothing is sent
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
        self._backend = validate_backend(backend)
        self._name = check_name(name)
        self._timing = _timing(ttl, renew_interval, margin, release_timeout)
        self._identity = (
            _checked_default_identity() if identity is None else check_identity(identity)
        )
        self._metadata = (
            _NO_METADATA if metadata is None else MappingProxyType(check_metadata(metadata))
        )
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

        :param timeout: give up after this many seconds; ``0`` tries once and does not wait
        :raises TimeoutError: ``timeout`` ran out; nothing is held
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
            try:
                return await self._acquire(blocking=False)
            except LeaseHeldError as exc:
                raise TimeoutError(f"timeout=0 and {exc}") from exc
        with anyio.fail_after(seconds):
            return await self._acquire(blocking=True)

    async def acquire_nowait(self) -> Lease:
        """Try once.

        :raises LeaseHeldError: somebody else holds it (``.holder`` says who), or this
            task does
        :raises BackendError: the backend failed; nothing is held
        """
        return await self._acquire(blocking=False)

    async def _acquire(self, *, blocking: bool) -> Lease:
        return await acquire_lease(
            self._backend,
            self._name,
            self._timing,
            self._identity,
            self._metadata,
            self._counters,
            blocking=blocking,
        )

    def hold(self, *, timeout: float | None = None) -> AbstractAsyncContextManager[Lease]:
        """``async with lock.hold(timeout=5) as lease:``: ``async with lock`` with a timeout."""
        if timeout is not None:
            check_seconds("timeout", timeout, allow_zero=True)
        return _Acquisition(self, timeout)

    async def __aenter__(self) -> Lease:
        context = _Acquisition(self, None)
        lease = await context.__aenter__()
        # Pair this enter with its exit per task (a context variable is per task, and
        # cheaper to read than the task's id), so one lock serves many tasks.
        _open.set((*_open.get(), context))
        return lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        stack = _open.get()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i]._lock is self:
                context = stack[i]
                _open.set(stack[:i] + stack[i + 1 :])
                return await context.__aexit__(exc_type, exc, tb)
        raise RuntimeError(f"{self!r}: __aexit__ without __aenter__ in this task")

    def statistics(self) -> LockStatistics:
        """A frozen snapshot of this lock's counters."""
        c = self._counters
        return LockStatistics(
            self._name, self._held, c.acquisitions, c.renewals, c.renew_failures, dict(c.losses)
        )
