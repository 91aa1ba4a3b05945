"""Campaigning for a name: the acquire loop that :class:`AsyncLock` and :class:`Elector`
share, and the defaults they fill in."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import anyio

from ._bridge import adapt
from ._checked import within_ttl
from ._clock import current_time, move_on_after
from ._exceptions import BackendTimeout, InvalidArgument, LeaseHeldError
from ._holding import Counters
from ._lease import Lease, Timing, release_shielded
from ._life import Tenancy
from ._permits import PermitRequest, permit_owner
from ._validate import check_identity
from .abc import Backend, Capability, Grant

__all__ = ["acquire_lease", "checked_default_identity", "default_identity", "validate_backend"]

_identity: tuple[int, str] = (-1, "")
#: The default identity once it passed :func:`check_identity`, per process.
_checked_identity: tuple[int, str] = (-1, "")


def default_identity() -> str:
    """``host:pid``, what the holder shows when it gives no identity (worked out once
    per process: a lock is often made per use)."""
    global _identity
    pid = os.getpid()
    if _identity[0] != pid:  # first use, or a forked child
        _identity = (pid, f"{socket.gethostname()}:{pid}"[:255])
    return _identity[1]


def checked_default_identity() -> str:
    """:func:`default_identity`, checked once per process.

    :raises InvalidArgument: the host name makes it more than 255 bytes of UTF-8
    """
    global _checked_identity
    pid = os.getpid()
    if _checked_identity[0] != pid:
        _checked_identity = (pid, check_identity(default_identity()))
    return _checked_identity[1]


def validate_backend(backend: object) -> Backend:
    """:raises InvalidArgument: ``backend`` is not a :class:`Backend`"""
    if not isinstance(backend, Backend):
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
    permit: PermitRequest | None = None,
) -> Lease:
    """Campaign for ``name`` until granted (or once, if not ``blocking``): for the lock,
    or for a permit of ``permit.weight`` out of ``permit.limit`` when ``permit`` is given
    (which is not reentrant-checked: a task may hold several permits of one name).

    A request whose reply may have been lost, or a queue entry left behind by a
    cancelled wait, is undone by a shielded release with the same owner id.

    :raises ReentrantAcquireError: ``blocking``, and the running task holds ``name``
        through ``backend`` in a block already (it would wait for itself); nothing is sent
    :raises LeaseHeldError: not ``blocking`` and somebody else (or this task) holds it
    :raises BackendError: the backend failed; nothing is held
    """
    tenancy = Tenancy.of(backend)
    if blocking and permit is None:
        tenancy.check_reentry(name)
    backend = adapt(backend)
    if permit is None:
        owner = os.urandom(16).hex()  # as random as uuid4().hex, for a fifth of the time
        fair = Capability.FAIR_QUEUE in backend.capabilities
    else:
        owner = permit_owner()
        fair = True  # a refused permit request is queued, or marks a writer waiting
    maybe_held = False
    started: float | None = None  # when the first request was sent
    try:
        while True:
            sent_at = current_time()
            if started is None:
                started = sent_at
            maybe_held = True
            if permit is None:
                result = await backend.try_acquire(name, owner, timing.ttl, identity, metadata)
            else:
                result = await backend.try_acquire_permit(
                    name, owner, timing.ttl, identity, metadata, permit.limit, permit.weight
                )
            if isinstance(result, Grant):
                # A driver may swallow a cancellation that arrived while it awaited the
                # reply (redis-py's asyncio client can): never hand a cancelled caller a lease.
                await anyio.lowlevel.checkpoint_if_cancelled()
                deadline = timing._deadline_after(sent_at, result)
                if deadline > current_time():
                    counters.acquisitions += 1
                    lease: Lease = Lease._create(
                        backend, name, owner, identity, metadata, timing, sent_at, result, deadline
                    )
                    tenancy.track(lease)
                    if lease._events.observers:
                        lease._events._emit("acquired", lease, current_time() - started)
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
            wait = backend.wait_turn if permit is None else backend.wait_permit_turn
            if within_ttl(wait):
                await wait(name, owner, timing.ttl, result)
            else:
                with move_on_after(timing.ttl):  # a retry within the ttl keeps a place
                    await wait(name, owner, timing.ttl, result)
    except BaseException as exc:
        events = backend.events
        if events.observers and started is not None:
            events._emit("acquire_failed", name, current_time() - started, exc)
        if maybe_held:
            await release_shielded(backend, name, owner, None, timing)
        raise
