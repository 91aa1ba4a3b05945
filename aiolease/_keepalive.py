"""The coroutines that guard a held lease, and the context that runs them.

While a lease is held, one task group runs:

* **keepalive**: renews every ``renew_interval`` (measured from the last confirmed
  send); retries backend errors with back-off until the local deadline; a
  "not owner" answer ends the lease at once.
* **expiry watch**: ends the lease at its local safe deadline, and, on backends
  that push changes, ends it as soon as somebody else takes the name.
* **session watch** (session backends): ends the lease as soon as the backend
  reports its session lost, or itself closed (:meth:`Backend.wait_lost`). A
  session backend that also reports takeovers there (:attr:`Backend.reports_takeover`)
  needs no takeover watch per lease: it watches all its grants at once.
* **health probe** (electors): ends the lease after ``health_failures``
  consecutive failed probes.

When the lease ends, the protected cancel scope is cancelled.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType

import anyio
from anyio.abc import TaskGroup, TaskStatus

from ._exceptions import BackendError, LossReason, NotOwnerError, lost_error
from ._lease import Lease, release_shielded
from .abc import Capability

logger = logging.getLogger("aiolease")

HealthCheck = Callable[[], "Awaitable[bool] | bool"]


@dataclass
class Counters:
    """Mutable counters behind the frozen ``statistics()`` snapshots."""

    acquisitions: int = 0
    renewals: int = 0
    renew_failures: int = 0
    losses: dict[LossReason, int] = field(default_factory=dict)

    def lost(self, reason: LossReason) -> None:
        self.losses[reason] = self.losses.get(reason, 0) + 1


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


async def keep_renewing(lease: Lease, counters: Counters) -> None:
    """Renew ``lease`` every renew interval until it ends."""
    timing = lease.timing
    backend = lease.backend
    next_at = lease.deadline - timing.ttl + timing.margin + timing.renew_interval
    backoff = min(0.05, timing.renew_interval / 4)
    while lease.lost is None:
        await anyio.sleep_until(next_at)
        sent_at = anyio.current_time()
        try:
            with anyio.fail_after(timing.renew_interval):
                grant = await backend.renew(lease.name, lease.owner, lease.token, timing.ttl)
        except NotOwnerError:
            lease.end(LossReason.STOLEN)
            return
        except (BackendError, TimeoutError) as exc:
            counters.renew_failures += 1
            lease.note_error(exc)
            logger.info("renewal of lease %r failed, retrying: %r", lease.name, exc)
            next_at = anyio.current_time() + backoff
            backoff = min(backoff * 2, timing.renew_interval)
            continue
        counters.renewals += 1
        lease.confirm(sent_at, grant)
        backoff = min(0.05, timing.renew_interval / 4)
        next_at = sent_at + timing.renew_interval


async def watch_deadline(lease: Lease) -> None:
    """End ``lease`` at its local safe deadline unless a renewal moved it."""
    while lease.lost is None:  # noqa: ASYNC110 - the deadline moves with every renewal
        await anyio.sleep_until(lease.deadline)


async def watch_takeover(lease: Lease) -> None:
    """End ``lease`` as soon as the backend shows another holder (push backends only)."""
    backend = lease.backend
    while lease.lost is None:
        try:
            holder = await backend.read(lease.name)
            if holder is None or holder.owner != lease.owner:
                lease.end(LossReason.STOLEN)
                return
            with anyio.move_on_after(lease.timing.ttl):
                await backend.wait_changed(lease.name, holder)
        except BackendError as exc:
            logger.debug("takeover watch of %r: %r", lease.name, exc)
            await anyio.sleep(lease.timing.renew_interval)


async def watch_session(lease: Lease) -> None:
    """End ``lease`` when its session backend reports the grant gone (session backends)."""
    backend = lease.backend
    while lease.lost is None:
        try:
            reason = await backend.wait_lost(lease.name, lease.owner, lease.token)
        except BackendError as exc:
            logger.debug("session watch of %r: %r", lease.name, exc)
            await anyio.sleep(lease.timing.renew_interval)
            continue
        lease.end(reason)
        return


async def watch_health(lease: Lease, policy: HealthPolicy) -> None:
    """End ``lease`` after ``policy.failures`` consecutive failed probes."""
    failures = 0
    while lease.lost is None:
        await anyio.sleep(policy.interval)
        failures = 0 if await probe(policy.check, policy.timeout) else failures + 1
        if failures >= policy.failures:
            lease.end(LossReason.UNHEALTHY)


class Holding:
    """The protected block of one held lease.

    Entering starts the guards; the body runs in a cancel scope that the end of the
    lease cancels. Leaving stops the guards, releases (shielded and bounded), and
    raises :class:`LeaseLostError` if the lease was lost; outer cancellation and
    the body's own exceptions propagate unchanged.
    """

    def __init__(
        self,
        lease: Lease,
        counters: Counters,
        health: HealthPolicy | None = None,
        on_lost: Callable[[LossReason], Awaitable[None]] | None = None,
    ) -> None:
        self.lease = lease
        self._counters = counters
        self._health = health
        self._on_lost = on_lost
        self._tg: TaskGroup | None = None
        self._body = anyio.CancelScope()

    async def _guard(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        lease = self.lease
        capabilities = lease.backend.capabilities
        session = Capability.SESSION in capabilities
        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_renewing, lease, self._counters)
            tg.start_soon(watch_deadline, lease)
            if Capability.PUSH_WAKEUP in capabilities and not (
                session and lease.backend.reports_takeover
            ):
                tg.start_soon(watch_takeover, lease)
            if session:
                tg.start_soon(watch_session, lease)
            if self._health is not None:
                tg.start_soon(watch_health, lease, self._health)
            task_status.started()
            await lease.wait_lost()
            tg.cancel_scope.cancel()

    async def __aenter__(self) -> Lease:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self._tg.start(self._guard)
        except BaseException as exc:
            self._tg.cancel_scope.cancel()
            try:
                # Under trio this re-raises the cancellation that got us here.
                await self._tg.__aexit__(type(exc), exc, exc.__traceback__)
            finally:
                await release_shielded(
                    self.lease.backend,
                    self.lease.name,
                    self.lease.owner,
                    self.lease.token,
                    self.lease.timing,
                )
            raise
        self.lease.on_end(lambda _: self._body.cancel())
        self._body.__enter__()
        return self.lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        assert self._tg is not None
        lease = self.lease
        cancelled_by_us = self._body.__exit__(exc_type, exc, tb)
        reason = lease.lost  # a passed deadline counts even if the body never checkpointed
        if reason is None:
            lease.end(LossReason.RELEASED)
        self._tg.cancel_scope.cancel()
        try:
            await self._tg.__aexit__(None, None, None)
        finally:
            await release_shielded(
                lease.backend, lease.name, lease.owner, lease.token, lease.timing
            )
        if reason is None or reason is LossReason.RELEASED:
            return cancelled_by_us
        self._counters.lost(reason)
        if self._on_lost is not None:
            await self._on_lost(reason)
        if exc is not None and not cancelled_by_us:
            raise lost_error(lease.name, reason) from exc
        raise lost_error(lease.name, reason)
