"""What guards a held lease, and the context that runs the guards.

While a lease is held:

* **renewals and the deadline**: the :class:`~aiolease._renewer.Renewer` of the
  backend (one task per backend object, for all its leases) renews the lease every
  ``renew_interval`` (measured from the last confirmed send), retries backend
  errors with back-off until the local deadline, ends the lease at once on a "not
  owner" answer, and ends it at its local safe deadline. A session backend that
  keeps the grant itself (:meth:`Backend.hold`) is not asked to renew: the deadline
  follows its session, and it reports the loss.
* **takeover watch** (push backends): ends the lease as soon as somebody else
  takes the name; a backend that reports takeovers by callback
  (:meth:`Backend.on_taken`) needs no task for it, and one that keeps the grant
  itself (:meth:`Backend.hold`) reports them with every other end of the grant.
* **session watch** (session backends without :meth:`Backend.hold`): ends the lease
  as soon as the backend reports its session lost, or itself closed
  (:meth:`Backend.wait_lost`).
* **health probe** (electors): ends the lease after ``health_failures``
  consecutive failed probes.
* **max_hold** (:mod:`aiolease._limits`): ends the lease when it was held that long.

When the lease ends, the protected cancel scope is cancelled.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio
from anyio.abc import TaskGroup

from ._bounds import Bounds
from ._clock import cancel_scope, checkpoint, current_time
from ._exceptions import BackendError, LossReason, NotOwnerError, lost_error
from ._lease import (
    Lease,
    log_fields,
    release_failed,
    release_finished,
    release_shielded,
    release_timed_out,
)
from ._life import Tenancy, closing, other_blocks_open
from ._limits import keep_held, watch_max_hold
from ._permits import is_permit_owner
from ._releases import Batch, Releases
from ._renewal_state import Counters
from ._renewer import Renewer
from .abc import Backend, Capability, HolderInfo, SessionClock

__all__ = ["Counters", "HealthCheck", "HealthPolicy", "Holding", "probe"]

logger = logging.getLogger("aiolease.lease")

HealthCheck = Callable[[], "Awaitable[bool] | bool"]
_Watch = tuple[Callable[..., Coroutine[Any, Any, None]], tuple[Any, ...]]


@dataclass(frozen=True)
class HealthPolicy:
    """How an elector probes its own health."""

    check: HealthCheck
    interval: float
    failures: int
    timeout: float


async def probe(check: HealthCheck, timeout: float) -> bool:
    """Run one health check; an exception, a timeout or a falsy result is a failure."""
    try:
        with anyio.fail_after(timeout):
            result = check()
            if inspect.isawaitable(result):
                result = await result
    except Exception as exc:  # the user's probe may fail in any way
        logger.warning("health probe failed: %r", exc)
        return False
    return bool(result)


def _ended(lease: Lease) -> bool:
    return lease.lost is not None


async def watch_takeover(lease: Lease) -> None:
    """End ``lease`` as soon as the backend shows another holder (push backends only).

    Waits for the backend's push notifications (:meth:`Backend.wait_taken`) and reads
    only when one came: no read at the start (the grant says who holds it) and none on
    a timer of its own (the renewals confirm ownership every renew interval).
    """
    backend = lease.backend
    name = lease.name
    held = HolderInfo(name, lease.owner, lease.identity, lease.token, lease.metadata)
    while lease.lost is None:
        try:
            await backend.wait_taken(name, held)
            if _ended(lease):
                return  # woken by its own release, say: nothing to read
            holder = await read_holder(backend, name, lease.owner)
        except BackendError as exc:
            logger.debug("takeover watch of %r: %r", name, exc, extra=log_fields(name, lease.token))
            await anyio.sleep(lease.timing.renew_interval)
            continue
        if holder is None or holder.owner != lease.owner:
            lease._end(LossReason.STOLEN)
            return
        held = holder


async def read_holder(backend: Backend, name: str, owner: str) -> HolderInfo | None:
    """The holder of lock ``name``; for a permit's ``owner``, that permit if it is live."""
    if not is_permit_owner(owner):
        return await backend.read(name)
    permits = await backend.read_permits(name)
    held = () if permits is None else permits.holders
    return next((holder for holder in held if holder.owner == owner), None)


async def watch_session(lease: Lease) -> None:
    """End ``lease`` when its session backend reports the grant gone (session backends)."""
    backend = lease.backend
    while lease.lost is None:
        try:
            reason = await backend.wait_lost(lease.name, lease.owner, lease.token)
        except BackendError as exc:
            logger.debug(
                "session watch of %r: %r",
                lease.name,
                exc,
                extra=log_fields(lease.name, lease.token),
            )
            await anyio.sleep(lease.timing.renew_interval)
            continue
        lease._end(reason)
        return


async def watch_health(lease: Lease, policy: HealthPolicy) -> None:
    """End ``lease`` after ``policy.failures`` consecutive failed probes."""
    failures = 0
    while lease.lost is None:
        await anyio.sleep(policy.interval)
        failures = 0 if await probe(policy.check, policy.timeout) else failures + 1
        if failures >= policy.failures:
            lease._end(LossReason.UNHEALTHY)


#: :meth:`Backend.hold` of every backend that keeps no grant itself: it returns ``None``.
_NO_HOLD = Backend.hold
_NO_RELEASE_NOW = Backend.release_now

#: How a lease of a lock with ``min_hold`` may end and still be kept for it (not lost to
#: anyone; ``None``: the block ended).
_KEPT = (None, LossReason.RELEASED, LossReason.MAX_HOLD)


class Holding:
    """The protected block of one held lease.

    Entering registers the lease with its backend's renewer and starts the watches
    it needs; the body runs in a cancel scope that the end of the lease cancels.
    Leaving releases (shielded and bounded) and raises :class:`LeaseLostError` if the
    lease was lost: then ``on_lost`` is called first, and the release of the lost
    lease is bounded by :meth:`Timing.release_bound`, so that neither waits for a
    release that cannot get through. Outer cancellation and the body's own
    exceptions propagate unchanged (a cancellation from outside wins over the loss).
    """

    __slots__ = (
        "_body",
        "_counters",
        "_health",
        "_left",
        "_on_lost",
        "_renewer",
        "_tg",
        "_unsubscribe",
        "_watching",
        "lease",
    )

    def __init__(
        self,
        lease: Lease,
        counters: Counters,
        health: HealthPolicy | None = None,
        on_lost: Callable[[LossReason], Awaitable[None]] | None = None,
        body: anyio.CancelScope | None = None,
    ) -> None:
        self.lease = lease
        self._counters = counters
        self._health = health
        self._on_lost = on_lost
        self._tg: TaskGroup | None = None
        self._renewer: Renewer | None = None
        #: The body's scope: given by a caller that made it before it waited for the grant.
        self._body = cancel_scope() if body is None else body
        self._left = False
        self._watching = False  # whether the task group runs watches of this lease
        self._unsubscribe: Callable[[], None] | None = None  # ends Backend.on_taken

    @property
    def task_group(self) -> TaskGroup:
        """The task group of this block (the renewer may run its task in it)."""
        assert self._tg is not None
        return self._tg

    def _hold(self) -> SessionClock | None:
        """Hand the lease to a session backend that keeps it (``None``: renew it)."""
        lease = self.lease
        backend = lease._backend
        if type(backend).hold is _NO_HOLD:  # (the default: no call, no argument checks)
            return None
        try:
            clock = backend.hold(lease._name, lease._owner, lease._token, lease._end)
        except NotOwnerError:
            # Gone before the block took it up: with the backend closing (its grants
            # ended first), or taken.
            lease._end(LossReason.SHUTDOWN if closing(backend) else LossReason.STOLEN)
            return None
        if clock is not None:
            lease._follow(clock)
        return clock

    def _watches(self, clock: SessionClock | None) -> list[_Watch]:
        lease = self.lease
        watches: list[_Watch] = []
        if clock is None:
            backend = lease._backend
            capabilities = backend.capabilities
            if Capability.PUSH_WAKEUP in capabilities:
                # A backend that reports takeovers by callback needs no task per lease.
                self._unsubscribe = backend.on_taken(
                    lease._name, lease._owner, lease._token, self._taken
                )
                if self._unsubscribe is None:
                    watches.append((watch_takeover, (lease,)))
            if Capability.SESSION in capabilities:
                watches.append((watch_session, (lease,)))
        if self._health is not None:
            watches.append((watch_health, (lease, self._health)))
        if lease._hold_until is not None:
            watches.append((watch_max_hold, (lease,)))
        return watches

    def _guard(self, clock: SessionClock | None, watches: list[_Watch]) -> None:
        renewer = self._renewer
        assert renewer is not None
        tg = self._tg
        if tg is not None or not renewer.add_soon(self.lease, self._counters, clock):
            renewer.add(None if tg is None else self, self.lease, self._counters, clock)
        for fn, args in watches:
            assert tg is not None
            tg.start_soon(fn, *args)
            self._watching = True

    def _taken(self, reason: LossReason) -> None:
        if self.lease.lost is None:  # a passed deadline is EXPIRED, not STOLEN
            self.lease._end(reason)

    def _unguard(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._renewer is not None and self._tg is not None:
            self._renewer.remove(self)
        if self._watching:
            assert self._tg is not None
            self._tg.cancel_scope.cancel()

    async def _release(
        self, sent: Awaitable[bool] | None = None, lost: LossReason | None = None
    ) -> None:
        lease = self.lease
        await release_shielded(
            lease._backend, lease._name, lease._owner, lease._token, lease._timing, sent, lost=lost
        )

    async def _leave_task_group(self) -> None:
        tg, self._tg = self._tg, None
        if tg is not None:
            await tg.__aexit__(None, None, None)

    async def _report_loss(self, reason: LossReason) -> None:
        """Tell of the loss at once: the guards' tasks are done with first (the task
        group's cancelled scope would cancel ``on_lost``), the release comes after."""
        await self._leave_task_group()
        self._counters.lost(reason)
        if self._on_lost is not None:
            await self._on_lost(reason)

    def _end_body(self, reason: LossReason) -> None:
        if reason is not LossReason.RELEASED or not self._left:
            self._body.cancel()

    async def __aenter__(self) -> Lease:
        lease = self.lease
        self._renewer = Renewer.of(lease._backend)
        clock = self._hold()
        watches = self._watches(clock)
        served = self._renewer.serve_here()
        if watches or not served:
            # For the watches, and to run the renewer's task when it is this block's turn
            # (a backend from open_backend() runs it in a task group of its own).
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
        try:
            if self._tg is not None:
                # A cancel that came while the task group was entered. (Without one,
                # nothing was awaited since the grant, which the acquire checked.)
                await anyio.lowlevel.checkpoint_if_cancelled()
            self._guard(clock, watches)
        except BaseException as exc:
            lease._end(LossReason.RELEASED)
            self._watching = self._tg is not None
            self._unguard()
            try:
                if self._tg is not None:
                    # Under trio this re-raises the cancellation that got us here.
                    await self._tg.__aexit__(type(exc), exc, exc.__traceback__)
            finally:
                await self._release()
            raise
        lease._on_end(self._end_body)
        Tenancy.of(lease._backend).enter_block(lease)
        self._body.__enter__()
        return lease

    async def _release_in_body(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        sent: Awaitable[bool] | None,
        releases: Releases,
        batch: Batch | None,
    ) -> bool:
        """Release a lease that ended in time (its verdict given, its guards gone) in the
        body's scope, now shielded and bounded as :func:`release_shielded` bounds a
        release, and leave that scope after: one cancel scope per block, not two. What
        the body raised goes on as it would (the scope was not cancelled: it swallows
        nothing of the body's); a release cut off by its bound is logged, as there."""
        lease = self.lease
        backend, name, token = lease._backend, lease._name, lease._token
        body = self._body
        body.shield = True
        failure: BaseException | None = None
        if other_blocks_open():
            # As in __aexit__: the other blocks ready to leave judge their leases first
            # (the body's scope shields this checkpoint).
            try:
                await checkpoint()
            except BaseException as error:  # (a native cancel): raised after the release
                failure = error
        if batch is not None:
            releases.close(batch)  # its step is over
        bound = lease._timing.release_bound(None)
        loop = asyncio._get_running_loop()
        bounds = None
        if loop is not None and asyncio.current_task(loop) is not None:
            bounds = Bounds.of(loop)
        started = current_time()
        if bounds is None:
            body.deadline = started + bound
        else:
            entry = bounds.add(started + bound, body)
        freed = False
        try:
            freed = await (backend.release(name, lease._owner, token) if sent is None else sent)
        except BackendError as error:
            release_failed(name, token, error)
        except BaseException as error:  # given to the scope, below
            failure = failure or error
        finally:
            if bounds is not None:
                bounds.done(entry)
        try:
            if failure is None:
                left = body.__exit__(exc_type, exc, tb)
            elif body.__exit__(type(failure), failure, failure.__traceback__):
                left = False  # the bound cut the release off: the body's exception goes on
                release_timed_out(backend, name, token, bound, started)
                return left
            else:
                raise failure
            if backend.events.observers:
                release_finished(backend, name, token, started, freed)
            return left
        finally:
            failure = None  # (no reference cycle through the traceback)
            if self._tg is not None:
                await self._leave_task_group()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        lease = self.lease
        # Sent before the bookkeeping below (leaving the body's scope included: nothing
        # is awaited in between), where the backend can: a waiter that the release
        # serves gets the lease sooner. But only by the first block that ends in this
        # step of the event loop: the others that end in it join its batch, sent after
        # the step (aiolease._releases), so that each is judged when its body ended,
        # not after the sends of those before it.
        # Judged before release_now, which may end the lease (a session backend tells
        # the core of every end of its grants): a deadline that passed before the body
        # ended is a loss, not a release.
        lost = lease.lost
        sent: Awaitable[bool] | None = None
        releases = Releases.of(lease._backend)
        batch = releases.batch  # the batch it joined or opened, if any
        joined = -1  # the index of its release in ``batch``, if it joined one
        if lease._keep_until is not None:  # (kept for min_hold, maybe)
            batch = None
        elif batch is not None and lost is None:
            joined = batch.add(lease._name, lease._owner, lease._token)
        elif type(lease._backend).release_now is _NO_RELEASE_NOW:
            batch = None  # (the default, which returns None: no call, no argument checks)
        else:
            batch = None
            try:
                sent = lease._backend.release_now(lease._name, lease._owner, lease._token)
            except Exception:  # a backend's bug: release() is called instead
                logger.exception(
                    "release_now of lease %r failed",
                    lease._name,
                    extra=log_fields(lease._name, lease._token),
                )
                sent = None
            if sent is not None and lost is None and releases.batch is None:
                batch = releases.batch = Batch()  # for those ending in this step
        if (
            joined < 0
            and lease._keep_until is None
            and lease.lost is None
            and not self._body.cancel_called
        ):
            # Ended in time (the usual end): released in the body's own scope.
            self._left = True
            lease._end(LossReason.RELEASED)  # the verdict
            self._unguard()
            return await self._release_in_body(exc_type, exc, tb, sent, releases, batch)
        reason: LossReason | None = None
        try:
            cancelled_by_us = self._body.__exit__(exc_type, exc, tb)
            self._left = True
            # A passed deadline counts even if the body never checkpointed.
            reason = lost if lost is not None else lease.lost
            if reason is None:
                lease._end(LossReason.RELEASED)  # the verdict: it ended in time
            self._unguard()
            if reason is None and other_blocks_open():
                # The rest (the release's bookkeeping, and its await) comes after every
                # other block ready to leave now has judged its own lease: when
                # thousands end at once, the last is judged when its body ended, not
                # after the others' releases (which would hold up the renewals of the
                # leases still held, until their deadline passed). Not needed when no
                # other block is open (this lease ended above): none can be waiting to
                # be judged, nor to join this step's batch.
                await anyio.lowlevel.cancel_shielded_checkpoint()
            if batch is not None:
                releases.close(batch)  # its step is over
            if reason is not None and reason is not LossReason.RELEASED:
                await self._report_loss(reason)
        finally:
            # Awaited before leaving the task group: the guards' tasks, cancelled
            # above, finish during its round trip, so leaving then costs no extra wait.
            # The release of a lost lease comes after the report, tightly bounded.
            if batch is not None:
                releases.close(batch)  # (an exception may have skipped the above)
            try:
                if joined >= 0:
                    assert batch is not None
                    with anyio.CancelScope(shield=True):
                        sent = await batch.sent_for(lease._backend, joined)
                if lease._keep_until is None or reason not in _KEPT:
                    await release_shielded(
                        lease._backend,
                        lease._name,
                        lease._owner,
                        lease._token,
                        lease._timing,
                        sent,
                        lost=reason,
                    )
                elif reason is not LossReason.RELEASED:  # (lease.release() kept that)
                    await keep_held(lease)  # min_hold
            finally:
                if self._tg is not None:
                    await self._leave_task_group()
        if reason is None or reason is LossReason.RELEASED:
            return cancelled_by_us
        if exc is not None and not cancelled_by_us:
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                return False  # cancelled from outside as well: that cancellation goes on
            raise lost_error(lease.name, reason) from exc
        raise lost_error(lease.name, reason)
