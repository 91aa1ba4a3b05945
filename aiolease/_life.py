"""What the leases of one backend object share while it is open.

Each backend object (the one the application made or :func:`aiolease.open_backend`
opened, never the trio bridge in front of it) has one :class:`Tenancy`, which knows

* every lease granted through it and not yet ended, however it was acquired
  (``async with``, :meth:`~aiolease.AsyncLock.acquire`, ``acquire_nowait()``, an
  elector's term). Closing the backend (every :meth:`Backend.aclose` goes through
  :func:`end_leases` first) ends them with :attr:`LossReason.SHUTDOWN`, which cancels
  their work, then releases them on the server: concurrently, shielded and within
  :data:`CLOSE_TIMEOUT`, so that the next holder need not wait out a ttl. A server
  that cannot be reached costs that much at most, and the leases expire on their own.
* which task holds which name in an open block (``async with lock``, an elector's
  term). Locks are not reentrant: a task that asks again for a name it holds in a
  block through the same backend object would wait for itself until the lease is
  lost, so :meth:`Tenancy.check_reentry` raises :class:`ReentrantAcquireError` at
  once instead. Only blocks count: a lease from ``acquire()`` may be handed to
  another task, which releases it while this one waits.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

import anyio

from ._bridge import AsyncioBridge
from ._clock import current_time
from ._exceptions import LossReason, ReentrantAcquireError
from ._lease import Lease
from ._permits import is_permit_owner
from ._renewer import stop_own_service
from .abc import Backend

__all__ = [
    "CLOSE_TIMEOUT",
    "Tenancy",
    "closing",
    "current_task",
    "end_leases",
    "other_blocks_open",
]

logger = logging.getLogger("aiolease.lease")

#: The longest that closing a backend waits for the releases of the leases still held
#: through it, in seconds (less if every such lease's ``release_timeout`` is shorter).
CLOSE_TIMEOUT = 5.0

#: How many leases a tenancy tracks before it first looks for lapsed ones.
_FIRST_SWEEP = 64

_tenancies: weakref.WeakKeyDictionary[Backend, Tenancy] = weakref.WeakKeyDictionary()
#: The backend objects whose closing has begun (see :func:`closing`).
_closing: weakref.WeakSet[Backend] = weakref.WeakSet()


def closing(backend: Backend) -> bool:
    """Whether ``backend`` (the object a lease was acquired through) is being closed, or
    was: a grant it refuses to keep (:meth:`Backend.hold`) ended with the backend
    (``SHUTDOWN``), not by a takeover."""
    return backend in _closing


#: How many leases are held in open blocks, through every backend (``[count]``).
_open_blocks = [0]


def other_blocks_open() -> bool:
    """Whether any lease is held in an open block now (the caller's, ended already, not
    counted): then another block may be ready to leave at this very moment."""
    return _open_blocks[0] > 0


def current_task() -> object:
    """The running task (asyncio's or trio's): the owner of a block, for the
    reentrancy check. Cheaper than ``anyio.get_current_task()``, which builds an object
    per call."""
    # No asyncio task runs in a trio task, even with a trio-asyncio loop open.
    loop = asyncio._get_running_loop()
    task = None if loop is None else asyncio.current_task(loop)
    if task is None:
        import trio

        return trio.lowlevel.current_task()
    return task


class Tenancy:
    """The live leases of one backend object, and the blocks that hold them."""

    __slots__ = ("__weakref__", "_sweep_at", "blocks", "leases")

    def __init__(self) -> None:
        #: Every lease granted through the backend and not yet ended.
        self.leases: dict[Lease, None] = {}
        #: Per name, the leases held in an open block, with the task that entered it.
        self.blocks: dict[str, list[tuple[object, Lease]]] = {}
        self._sweep_at = _FIRST_SWEEP

    @classmethod
    def of(cls, backend: Backend) -> Tenancy:
        """The tenancy of ``backend`` (of the backend behind it, if it is the trio bridge)."""
        if type(backend) is AsyncioBridge:  # (cheaper than an ABC's isinstance)
            backend = backend.inner
        tenancy = _tenancies.get(backend)
        if tenancy is None:
            tenancy = _tenancies[backend] = cls()
        return tenancy

    def track(self, lease: Lease) -> None:
        """Know ``lease`` until it ends (a new grant: :func:`end_leases` ends it)."""
        leases = self.leases
        if len(leases) >= self._sweep_at:
            self._sweep()
        leases[lease] = None
        lease._on_end(lambda _: leases.pop(lease, None))

    def _sweep(self) -> None:
        """Forget the leases past their deadline that nobody looked at since (a lease
        from ``acquire()`` that its caller dropped): reading :attr:`Lease.lost` ends
        them. Each sweep follows as many grants as it keeps leases: O(1) per grant on
        average."""
        for lease in list(self.leases):
            _ = lease.lost
        self._sweep_at = max(2 * len(self.leases), _FIRST_SWEEP)

    def enter_block(self, lease: Lease) -> None:
        """The running task holds ``lease`` in a block until the lease ends."""
        entry = (current_task(), lease)
        name = lease.name
        blocks = self.blocks
        blocks.setdefault(name, []).append(entry)
        _open_blocks[0] += 1

        def leave(_: LossReason) -> None:
            _open_blocks[0] -= 1
            entries = blocks.get(name)
            if entries is not None:
                entries.remove(entry)
                if not entries:
                    del blocks[name]

        lease._on_end(leave)

    def check_reentry(self, name: str) -> None:
        """:raises ReentrantAcquireError: the running task holds ``name`` in a block"""
        entries = self.blocks.get(name)
        if entries:
            task = current_task()
            for holder, lease in entries:
                if holder is task and lease.lost is None and not is_permit_owner(lease.owner):
                    raise ReentrantAcquireError(name)


async def end_leases(backend: Backend) -> None:
    """End every lease still held through ``backend`` (:attr:`LossReason.SHUTDOWN`),
    then release them through ``backend``: concurrently, shielded from cancellation,
    within :data:`CLOSE_TIMEOUT`. Never raises for backend trouble (it is logged once).

    ``backend`` is the object being closed: the trio bridge (released from trio) or the
    backend itself (released on its own loop).
    """
    _closing.add(backend)
    try:
        await _end_tenancy(backend)
    finally:
        stop_own_service(backend)


async def _end_tenancy(backend: Backend) -> None:
    tenancy = _tenancies.get(backend.inner if type(backend) is AsyncioBridge else backend)
    if tenancy is None or not tenancy.leases:
        return
    leases = list(tenancy.leases)
    for lease in leases:
        lease._end(LossReason.SHUTDOWN)  # the work stops before the name is freed
    timeout = min(CLOSE_TIMEOUT, max(lease.timing.release_timeout for lease in leases))
    errors: list[Exception] = []
    released: list[Lease] = []
    with anyio.CancelScope(shield=True, deadline=current_time() + timeout):
        # Once round the loop first: cancelled bodies leave their blocks before their
        # names are freed, as far as they can without waiting.
        await anyio.lowlevel.checkpoint()
        async with anyio.create_task_group() as tg:
            for lease in leases:
                tg.start_soon(_release, backend, lease, released, errors)
    left = len(leases) - len(released)
    if left:
        logger.warning(
            "closing %r: %d of %d leases still held were not released (they expire on "
            "their own): %s",
            backend,
            left,
            len(leases),
            repr(errors[0]) if errors else f"timed out after {timeout:g}s",
        )


async def _release(
    backend: Backend, lease: Lease, released: list[Lease], errors: list[Exception]
) -> None:
    try:
        await backend.release(lease.name, lease.owner, lease.token)
    except Exception as exc:  # a dead server (or a driver's bug) must not fail the close
        errors.append(exc)
    else:
        released.append(lease)
