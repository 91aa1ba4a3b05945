"""Scheduled jobs across a fleet: run a job at most once per interval, wherever it runs.

Both helpers hold an :class:`~aiolease.AsyncLock` on the job's name with
``min_hold=every`` (ShedLock's ``lockAtLeastFor``): a run keeps the name for
``every`` seconds from its grant, even if it finished sooner, so no other process
starts the job again before then.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any, NoReturn

import anyio

from ._exceptions import BackendError, LeaseHeldError, LeaseLostError
from ._limits import check_duration
from ._lock import AsyncLock
from .abc import Backend

__all__ = ["run_at_most_once", "run_every"]

logger = logging.getLogger("aiolease")

#: The longest default ttl of a job's lock, in seconds: how long the name stays taken
#: after a process died while running the job.
DEFAULT_TTL = 30.0

Job = Callable[..., Awaitable[object]]


def _lock(
    backend: Backend,
    name: str,
    every: float | timedelta,
    ttl: float | None,
    max_hold: float | timedelta | None,
    identity: str | None,
    metadata: Mapping[str, str] | None,
) -> AsyncLock:
    every_s = check_duration("every", every)
    return AsyncLock(
        backend,
        name,
        ttl=min(every_s, DEFAULT_TTL) if ttl is None else ttl,
        min_hold=every_s,
        max_hold=max_hold,
        identity=identity,
        metadata=metadata,
    )


async def run_at_most_once(
    backend: Backend,
    name: str,
    fn: Job,
    *args: Any,
    every: float | timedelta,
    ttl: float | None = None,
    max_hold: float | timedelta | None = None,
    identity: str | None = None,
    metadata: Mapping[str, str] | None = None,
) -> bool:
    """Run ``await fn(lease, *args)`` now, unless a process started it (here or
    anywhere else that shares the backend) less than ``every`` ago: for a job that every
    machine's own timer (cron, a loop) starts, and one of them should run.

    One try, no wait. The job's lock is held while it runs (renewed, and the job
    cancelled if it is lost, as for any ``async with lock``), then kept until ``every``
    after its grant.

    :param every: seconds or a :class:`~datetime.timedelta`
    :param ttl: the lock's ttl (default ``min(every, 30 s)``): how long the name stays
        taken if the process running the job dies
    :param max_hold: cancel a run that takes longer (:attr:`LossReason.MAX_HOLD`)
    :returns: whether ``fn`` ran here
    :raises LeaseLostError: the lock was lost while ``fn`` ran; ``fn`` was cancelled
    :raises BackendError: the backend failed; ``fn`` did not run
    """
    lock = _lock(backend, name, every, ttl, max_hold, identity, metadata)
    started = False
    try:
        async with lock.hold(timeout=0) as lease:
            started = True
            await fn(lease, *args)
    except LeaseHeldError:
        if started:
            raise
        return False
    except TimeoutError as exc:
        if started or not isinstance(exc.__cause__, LeaseHeldError):
            raise
        return False
    return True


async def run_every(
    backend: Backend,
    name: str,
    fn: Job,
    *args: Any,
    every: float | timedelta,
    ttl: float | None = None,
    max_hold: float | timedelta | None = None,
    identity: str | None = None,
    metadata: Mapping[str, str] | None = None,
) -> NoReturn:
    """Run ``await fn(lease, *args)`` once per ``every`` across every process that runs
    this for ``name``, forever: wait for the name, run the job, keep the name until
    ``every`` after its grant; repeat. Whichever process gets the name runs the job,
    so it goes on while any of them is alive.

    A run that loses its lock is cancelled and logged, and a backend failure is logged
    and retried; the loop goes on. An exception from ``fn`` ends it. Stop it by
    cancelling it.

    :param every: seconds or a :class:`~datetime.timedelta`
    :param ttl: see :func:`run_at_most_once`
    :param max_hold: see :func:`run_at_most_once`
    """
    lock = _lock(backend, name, every, ttl, max_hold, identity, metadata)
    backoff = min(lock.timing.ttl / 4, 1.0)
    while True:
        try:
            async with lock as lease:
                await fn(lease, *args)
        except LeaseLostError as exc:
            logger.warning("run of %r lost its lock: %s", name, exc.reason.value)
        except BackendError as exc:
            logger.warning("scheduling %r failed: %r", name, exc)
            await anyio.sleep(backoff * random.uniform(0.5, 1.5))
