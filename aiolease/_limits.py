"""How long a lock may keep its name (``max_hold``), and how long it must (``min_hold``).

* ``max_hold``: a lease is not renewed past ``max_hold`` seconds after its acquire
  was sent. A block or an elector's term holding it ends then: the body is
  cancelled, :class:`LeaseLostError` is raised with :attr:`LossReason.MAX_HOLD`, and
  the lease is released. (:meth:`Lease.renew` of a lease from ``acquire()`` refuses
  past it the same way.) Measured from the send time, so the limit ends the lease
  early rather than late.
* ``min_hold`` (ShedLock's ``lockAtLeastFor``): when a lease of an
  :class:`~aiolease.AsyncLock` is released before ``min_hold`` seconds passed since it
  was granted, it is not deleted: one renewal with the time left as its ttl leaves
  the grant on the server until then, and nothing renews it again. The local lease
  is done at once; nobody else gets the name before the time is up. Measured from
  the time the grant came back, so the name is kept at least that long.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from datetime import timedelta

import anyio

from ._clock import current_time
from ._exceptions import (
    BackendError,
    InvalidArgument,
    LossReason,
    NotOwnerError,
    UnsupportedCapability,
)
from ._lease import Lease, release_shielded
from ._validate import MAX_TTL, check_seconds
from .abc import Backend, Capability

__all__ = ["HoldLimits", "age", "check_duration", "keep_held", "watch_max_hold"]

logger = logging.getLogger("aiolease")


def check_duration(what: str, value: object) -> float:
    """Seconds, from a number or a :class:`~datetime.timedelta`.

    :raises InvalidArgument: unless ``value`` is finite, positive and at most 365 days
    """
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    checked = check_seconds(what, seconds)
    if checked > MAX_TTL:
        raise InvalidArgument(f"{what} must be at most {MAX_TTL:g} seconds (365 days)")
    return checked


@dataclass(frozen=True, slots=True)
class HoldLimits:
    """The validated ``max_hold`` and ``min_hold`` of a lock or elector (``None``: no limit)."""

    max_hold: float | None
    min_hold: float | None

    @classmethod
    def build(cls, backend: Backend, max_hold: object, min_hold: object) -> HoldLimits | None:
        """:returns: ``None`` when neither is given (nothing to do per grant)
        :raises InvalidArgument: either is not a positive finite number of seconds (or a
            timedelta) of at most 365 days
        :raises UnsupportedCapability: ``min_hold`` on a session backend, whose grants
            live as long as the session, not for a ttl a renewal sets
        """
        if max_hold is None and min_hold is None:
            return None
        max_s = None if max_hold is None else check_duration("max_hold", max_hold)
        min_s = None if min_hold is None else check_duration("min_hold", min_hold)
        if min_s is not None and Capability.SESSION in backend.capabilities:
            raise UnsupportedCapability(
                f"{backend!r} keeps grants alive by a session (Capability.SESSION), not by a"
                " ttl that a renewal sets: min_hold cannot leave a grant behind on it"
            )
        return cls(max_s, min_s)

    def apply(self, lease: Lease) -> Lease:
        """Set the limits of a new grant (just returned by its acquire)."""
        if self.max_hold is not None:
            lease._hold_until = lease._acquired_at + self.max_hold
        if self.min_hold is not None:
            lease._keep_until = current_time() + self.min_hold
        return lease


#: Per lease whose ``max_hold`` is watched: set when :func:`age` moved its limit.
_moved: weakref.WeakKeyDictionary[Lease, anyio.Event] = weakref.WeakKeyDictionary()


async def watch_max_hold(lease: Lease) -> None:
    """End ``lease`` with :attr:`LossReason.MAX_HOLD` at its ``max_hold``."""
    while lease.lost is None:  # (a deadline passed first is EXPIRED, not MAX_HOLD)
        until = lease._hold_until
        assert until is not None
        if current_time() >= until:
            lease._end(LossReason.MAX_HOLD)
            return
        moved = _moved[lease] = anyio.Event()
        with anyio.move_on_at(until):
            await moved.wait()


def age(lease: Lease, seconds: float) -> None:
    """Count ``seconds`` more of ``lease``'s life towards its limits, as if they had
    passed (:class:`~aiolease.testing.memory.DrivenMemoryBackend` moves time so)."""
    if lease._hold_until is not None:
        lease._hold_until -= seconds
        moved = _moved.get(lease)
        if moved is not None:
            moved.set()
    if lease._keep_until is not None:
        lease._keep_until -= seconds


async def keep_held(lease: Lease) -> bool:
    """Release ``lease`` (ended, not lost) for ``min_hold``: leave its grant on the server
    until :attr:`Lease._keep_until` by one renewal with the time left as its ttl, or
    release it if that time has come. Shielded and bounded by the release timeout;
    never raises for backend trouble (logged: the grant then expires on its own).

    :returns: whether the grant was left in place (or released)
    """
    until = lease._keep_until
    assert until is not None
    timing = lease.timing
    left = until - current_time()
    if left <= 0:
        return await release_shielded(lease.backend, lease.name, lease.owner, lease.token, timing)
    with anyio.CancelScope(deadline=current_time() + timing.release_timeout, shield=True):
        try:
            await lease.backend.renew(lease.name, lease.owner, lease.token, min(left, MAX_TTL))
        except NotOwnerError:
            logger.warning("lease %r was gone before min_hold was up: not kept", lease.name)
            return False
        except BackendError as exc:
            logger.warning(
                "keeping lease %r for min_hold failed: %s (it expires on its own)", lease.name, exc
            )
            return False
        return True
    logger.warning("keeping lease %r for min_hold timed out", lease.name)
    return False
