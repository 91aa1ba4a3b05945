"""The lease handle and its timing model.

Timing (all on ``anyio.current_time()``, the local monotonic clock)::

    t_sent                          t_sent + renew_interval        deadline      server expiry
      |--- request sent                |--- next renewal sent        |             |
      |<------------------------- ttl - margin --------------------->|<-- margin ->|
      |<-------------------------------- ttl ---------------------------------------->|

The server starts its ttl no earlier than it receives the request, which is no
earlier than ``t_sent``; so ``deadline = t_sent + ttl - margin`` falls before the
server can hand the name to anyone else, by at least ``margin`` (clock-rate drift
plus the time the holder needs to stop its work).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NoReturn, final

import anyio

from ._bounds import Bounds
from ._clock import cancel_scope, current_time
from ._exceptions import (
    BackendError,
    InvalidArgument,
    LossReason,
    NotOwnerError,
    lost_error,
)
from ._validate import check_seconds, check_ttl
from .abc import Backend, Grant, SessionClock

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

logger = logging.getLogger("aiolease.lease")

#: The smallest margin used when none is given, in seconds.
MIN_MARGIN = 0.05


@final
@dataclass(frozen=True, slots=True)
class Timing:
    """The validated timing of a lock or elector (see the module docstring)."""

    ttl: float
    renew_interval: float
    margin: float
    release_timeout: float

    @classmethod
    def _build(
        cls,
        ttl: object,
        renew_interval: object = None,
        margin: object = None,
        release_timeout: object = None,
    ) -> Self:
        """Validate and fill in defaults.

        :raises InvalidArgument: ``ttl <= 0`` or over 365 days, or the renew interval does not fit
            in ``ttl - margin``
        """
        ttl_s = check_ttl(ttl)
        margin_s = (
            max(0.1 * ttl_s, MIN_MARGIN)
            if margin is None
            else check_seconds("margin", margin, allow_zero=True)
        )
        if margin_s >= ttl_s:
            raise InvalidArgument(f"margin ({margin_s:g}s) must be smaller than ttl ({ttl_s:g}s)")
        renew_s = (
            ttl_s / 3 if renew_interval is None else check_seconds("renew_interval", renew_interval)
        )
        if renew_s >= ttl_s - margin_s:
            raise InvalidArgument(
                f"renew_interval ({renew_s:g}s) must be shorter than ttl - margin "
                f"({ttl_s:g}s - {margin_s:g}s): the lease would lapse between renewals"
            )
        release_s = (
            min(max(ttl_s, 1.0), 10.0)
            if release_timeout is None
            else check_seconds("release_timeout", release_timeout)
        )
        return cls(ttl_s, renew_s, margin_s, release_s)

    def release_bound(self, lost: LossReason | None) -> float:
        """How long the release of a lease that ended with ``lost`` may take.

        ``release_timeout``; but a lease lost at or past its deadline (``EXPIRED``,
        ``UNREACHABLE``) or no longer ours (``STOLEN``) gets at most ``margin`` (at
        least :data:`MIN_MARGIN`): the server frees it by itself about then, and the
        holder must learn of the loss at once, not when a release that cannot get
        through times out.
        """
        if lost in _LAPSED:
            return min(self.release_timeout, max(self.margin, MIN_MARGIN))
        return self.release_timeout

    def _deadline_after(self, sent_at: float, grant: Grant) -> float:
        """The local safe deadline for a grant confirmed by a request sent at ``sent_at``."""
        return effective_sent(sent_at, grant) + min(self.ttl, grant.ttl) - self.margin

    def _renewal_after(self, sent_at: float, grant: Grant) -> float:
        """When to renew a grant confirmed by a request sent at ``sent_at``: a renew
        interval after the confirmation's effective send time, shortened in proportion
        when the server granted less than the ttl asked for."""
        good_for = min(self.ttl, grant.ttl)
        return effective_sent(sent_at, grant) + self.renew_interval * min(good_for / self.ttl, 1.0)


#: Losses after which the server frees the name by itself within about ``margin``.
_LAPSED = frozenset({LossReason.EXPIRED, LossReason.UNREACHABLE, LossReason.STOLEN})


def effective_sent(sent_at: float, grant: Grant) -> float:
    """The earlier of the core's own send time and the backend's :attr:`Grant.sent_at`."""
    return sent_at if grant.sent_at is None else min(sent_at, grant.sent_at)


class Ride:
    """The renewal state that the leases of one cohort share (see
    ``docs/internals/renewal.md``): the scheduler confirms them all at once by updating
    this, not each lease, and a lease reads it lazily, through its own fields (which
    never say more than was confirmed: a lease's deadline is the later of its own and
    its ride's). A lease leaves its ride (:meth:`Lease._leave_ride`) when it ends or is
    renewed apart; it never joins one again. A lease that joins a ride after it was made
    (renewed in the same call as its cohort, then confirmed with it) offsets its own
    count by the confirmations the ride had counted before it joined.

    :param deadline: the local safe deadline of the ride's last confirmation
    :param renew_at: when to renew them next
    """

    __slots__ = ("deadline", "renew_at", "renewals", "unconfirmed")

    def __init__(self, deadline: float, renew_at: float) -> None:
        self.deadline = deadline
        self.renew_at = renew_at
        #: A renewal was sent since the last confirmation.
        self.unconfirmed = False
        #: Confirmations since it was made (a lease that joined later offsets its own
        #: count by those counted before it joined).
        self.renewals = 0


class _NoPublicConstructor(type):
    """Instances are made only by the library, through ``_create``."""

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(f"{cls.__module__}.{cls.__qualname__} has no public constructor")

    def _create(cls, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)


@final
class Lease(metaclass=_NoPublicConstructor):
    """A granted lease: the handle the protected work receives.

    Pass :attr:`token` to the resource you protect, so that it can reject writes
    from an older holder (fencing).
    """

    # Slots: a process may hold many thousands, and the renewal scheduler touches each
    # every renew interval; a lease without a ``__dict__`` is smaller and faster to reach.
    __slots__ = (
        "__weakref__",
        "_acquired_at",
        "_backend",
        "_callbacks",
        "_clock",
        "_deadline",
        "_ended",
        "_events",
        "_hold_until",
        "_identity",
        "_keep_until",
        "_metadata",
        "_name",
        "_owner",
        "_reason",
        "_renew_at",
        "_renewals",
        "_ride",
        "_timing",
        "_token",
        "_unconfirmed",
        "_warned",
    )

    def __init__(
        self,
        backend: Backend,
        name: str,
        owner: str,
        identity: str,
        metadata: Mapping[str, str],
        timing: Timing,
        sent_at: float,
        grant: Grant,
        deadline: float,
    ) -> None:
        """``deadline``: ``timing._deadline_after(sent_at, grant)``, which the caller
        worked out to judge the grant."""
        self._backend = backend
        self._name = name
        self._owner = owner
        self._identity = identity
        # A lock's metadata is a read-only view of a dict nobody else holds: shared.
        self._metadata = (
            metadata if type(metadata) is MappingProxyType else MappingProxyType(dict(metadata))
        )
        self._timing = timing
        self._token = grant.token
        self._deadline = deadline
        self._renew_at = timing._renewal_after(sent_at, grant)
        self._clock: SessionClock | None = None
        self._acquired_at = sent_at
        self._events = backend.events
        self._reason: LossReason | None = None
        self._ended: anyio.Event | None = None  # made by wait_lost(), on first use
        self._callbacks: list[Callable[[LossReason], object]] = []
        self._unconfirmed = False  # a renewal was sent since the last confirmation
        self._renewals = 0
        #: The state it shares with the leases renewed with it, if any (:class:`Ride`).
        self._ride: Ride | None = None
        self._warned = False
        #: ``max_hold``: not renewed from then on (:mod:`aiolease._limits`); ``None``: no limit.
        self._hold_until: float | None = None
        #: ``min_hold``: a release before then leaves the grant until then (``_limits``).
        self._keep_until: float | None = None

    def __repr__(self) -> str:
        state = self._reason.value if self._reason else f"{self.remaining:.3f}s left"
        return f"<Lease {self._name!r} token={self._token} identity={self._identity!r} {state}>"

    @property
    def name(self) -> str:
        """The lease name."""
        return self._name

    @property
    def owner(self) -> str:
        """The opaque owner id of this grant, unique per acquire attempt."""
        return self._owner

    @property
    def identity(self) -> str:
        """The identity published with this grant."""
        return self._identity

    @property
    def metadata(self) -> Mapping[str, str]:
        """The metadata published with this grant (read-only)."""
        return self._metadata

    @property
    def token(self) -> int:
        """The fencing token: strictly greater than every earlier grant's for this name."""
        return self._token

    @property
    def ttl(self) -> float:
        """The ttl requested from the backend, in seconds."""
        return self._timing.ttl

    @property
    def deadline(self) -> float:
        """The local safe deadline on ``anyio.current_time()``; the lease is lost at it."""
        if self._clock is not None and self._reason is None:
            self._follow_clock()
        ride = self._ride
        if ride is not None and ride.deadline > self._deadline:
            return ride.deadline
        return self._deadline

    @property
    def lost(self) -> LossReason | None:
        """Why the lease ended, or ``None`` while it is held.

        Reading this after the deadline ends the lease even if the watchdog has not
        woken up yet: :attr:`LossReason.UNREACHABLE` if a renewal was sent since the
        last confirmed one (it failed, or is still unanswered), else
        :attr:`LossReason.EXPIRED`.
        """
        if self._reason is None:
            return self._lost_at(current_time())
        return self._reason

    def _lost_at(self, now: float) -> LossReason | None:
        """:attr:`lost`, read at ``now`` (the current time, read once by the caller)."""
        if self._reason is None and now >= self._deadline:
            unreachable = self._unconfirmed
            ride = self._ride
            if ride is not None:  # its own deadline may lag behind its ride's
                if now < ride.deadline:
                    return None
                unreachable = unreachable or ride.unconfirmed
            elif self._clock is not None:
                self._follow_clock()
                unreachable = unreachable or self._clock.error is not None
            if now >= self._deadline:
                self._end(LossReason.UNREACHABLE if unreachable else LossReason.EXPIRED)
        return self._reason

    def _follow_clock(self) -> None:
        assert self._clock is not None
        self._deadline = max(self._deadline, self._clock.expires - self._timing.margin)

    @property
    def remaining(self) -> float:
        """Seconds left before the local safe deadline (0 once lost)."""
        if self.lost is not None:
            return 0.0
        return max(self.deadline - current_time(), 0.0)

    async def wait_lost(self) -> LossReason:
        """Wait until the lease ends and return why."""
        while (reason := self.lost) is None:
            if self._ended is None:
                self._ended = anyio.Event()
            with anyio.move_on_at(self.deadline):
                await self._ended.wait()
        return reason

    async def renew(self) -> None:
        """Renew once now (``async with`` and electors do this for you).

        :raises LeaseLostError: the lease is lost, or the backend no longer has it
        :raises BackendError: the renewal failed; the lease stays valid until its deadline
        """
        self._raise_if_lost()
        sent_at = current_time()
        if self._hold_until is not None and sent_at >= self._hold_until:
            self._end(LossReason.MAX_HOLD)
            self._raise_if_lost()
        self._unconfirmed = True
        try:
            grant = await self._backend.renew(
                self._name, self._owner, self._token, self._timing.ttl
            )
        except NotOwnerError:
            self._end(LossReason.STOLEN)
            self._raise_if_lost()
            raise
        except BackendError as exc:
            if self._events.observers:
                self._events._emit("renew_failed", self, exc)
            raise
        self._confirm(sent_at, grant)
        if self._events.observers:
            self._events._emit("renewed", (self,), current_time() - sent_at)

    async def ensure_held(self) -> None:
        """Ask the backend, in one read, whether this grant still holds the name.

        A read, not a renewal: the lease's expiry is left as it is. When the backend
        reports another holder (another owner id: every acquire attempt has its own),
        or nobody, the lease ends here with :attr:`LossReason.STOLEN`, as when a renewal
        hears "not owner": the protected block is cancelled and raises
        :class:`LeaseLostError`, and :attr:`lost` says so. A lease known to be lost or
        released raises at once, without a round trip.

        :raises LeaseLostError: the lease is lost (now or before)
        :raises BackendError: the read failed; the lease stays valid until its deadline
        """
        self._raise_if_lost()
        holder = await self._backend.read(self._name)
        # A deadline passed or a release made while reading comes first (``lost``).
        # The owner id is unique per acquire attempt: it alone names this grant (as for
        # the takeover watch; a Redlock read may report a grant's token as counted by
        # another majority of its instances).
        if self.lost is None and (holder is None or holder.owner != self._owner):
            self._end(LossReason.STOLEN)
        self._raise_if_lost()

    async def release(self) -> bool:
        """Release the lease: shielded, bounded by the release timeout, idempotent.

        A lease lost at its deadline or taken by someone else is released for at most
        its margin (:meth:`Timing.release_bound`): the server frees it by then anyway.

        A lease of a lock with ``min_hold`` released before that time is left on the
        server until then (see :class:`~aiolease.AsyncLock`).

        :returns: ``True`` if this call freed it; ``False`` if it was already
            released or lost (logged once), or the backend could not be told
        """
        reason = self.lost
        if reason is LossReason.RELEASED:
            return False
        if reason is None:
            self._end(LossReason.RELEASED)
        elif not self._warned:
            self._warned = True
            logger.warning(
                "release of lease %r after it was lost (%s)",
                self._name,
                reason.value,
                extra=log_fields(self._name, self._token, reason),
            )
        if self._keep_until is not None and reason in (None, LossReason.MAX_HOLD):
            from ._limits import keep_held  # (which imports this module)

            return await keep_held(self) and reason is None
        # Even a lost lease may still sit on the server; the owner check makes this safe.
        freed = await release_shielded(
            self._backend, self._name, self._owner, self._token, self._timing, lost=reason
        )
        return freed and reason is None

    # -- used by the core (the renewer, the holding block, the acquire loop) ------------

    def _confirm(self, sent_at: float, grant: Grant) -> None:
        """Record a confirmed renewal sent at ``sent_at``; never moves the deadline back."""
        timing = self._timing
        self._confirm_at(
            timing._deadline_after(sent_at, grant), timing._renewal_after(sent_at, grant)
        )

    def _confirm_at(self, deadline: float, renew_at: float) -> None:
        """Record a confirmed renewal that gives ``deadline`` and the next renewal time
        ``renew_at`` (:meth:`_confirm`, worked out by the caller)."""
        if self._reason is None:
            if deadline > self._deadline:
                self._deadline = deadline
            self._renew_at = renew_at
            self._unconfirmed = False
            self._renewals += 1

    def _next_renewal(self) -> float:
        """When the last confirmation says to renew next (see :meth:`Timing._renewal_after`)."""
        ride = self._ride
        return self._renew_at if ride is None else max(self._renew_at, ride.renew_at)

    def _leave_ride(self) -> int:
        """Take its ride's state into its own fields and leave it (:class:`Ride`); the
        confirmations it counted meanwhile (0 without a ride)."""
        ride = self._ride
        if ride is None:
            return 0
        self._ride = None
        if ride.deadline > self._deadline:
            self._deadline = ride.deadline
        if ride.renew_at > self._renew_at:
            self._renew_at = ride.renew_at
        self._unconfirmed = self._unconfirmed or ride.unconfirmed
        self._renewals += ride.renewals
        return ride.renewals

    def _follow(self, clock: SessionClock) -> None:
        """From now on, the deadline follows ``clock`` (the session that keeps the grant,
        :meth:`Backend.hold`): ``clock.expires - margin``, never earlier than it is."""
        self._clock = clock

    def _renewal_sent(self, now: float | None = None) -> None:
        """A renewal is being sent now (``now``, if the caller read the time): if the
        deadline passes before a renewal is confirmed, the backend could not be reached
        (``UNREACHABLE``), whether this one failed or is never answered. (Sent once the
        deadline has passed, it is too late: the lease has ``EXPIRED``.)"""
        if self._lost_at(current_time() if now is None else now) is None:
            self._unconfirmed = True

    def _note_error(self, exc: BaseException) -> None:
        """Remember a failed renewal (it was sent: see :meth:`_renewal_sent`)."""
        if self._reason is None:
            self._unconfirmed = True

    def _on_end(self, callback: Callable[[LossReason], object]) -> None:
        """Call ``callback(reason)`` when the lease ends (at once if it has)."""
        if self._reason is not None:
            callback(self._reason)
        else:
            self._callbacks.append(callback)

    def _end(self, reason: LossReason) -> None:
        """Mark the lease ended with ``reason`` (first reason wins)."""
        if self._reason is not None:
            return
        self._reason = reason
        if reason is not LossReason.RELEASED:
            logger.warning(
                "lease %r (token %d) lost: %s",
                self._name,
                self._token,
                reason.value,
                extra=log_fields(self._name, self._token, reason),
            )
        if self._ended is not None:
            self._ended.set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(reason)
        if self._events.observers:  # after the callbacks: the work is cancelled first
            held = current_time() - self._acquired_at
            if reason is LossReason.RELEASED:
                self._events._emit("released", self, held)
            else:
                self._events._emit("lost", self, reason, held)

    def _raise_if_lost(self) -> None:
        reason = self.lost
        if reason is not None:
            raise lost_error(self._name, reason)

    @property
    def backend(self) -> Backend:
        """The backend this lease lives on."""
        return self._backend

    @property
    def timing(self) -> Timing:
        """The timing this lease was granted with."""
        return self._timing

    @property
    def renewals(self) -> int:
        """How many renewals were confirmed."""
        ride = self._ride
        return self._renewals if ride is None else self._renewals + ride.renewals


async def release_shielded(
    backend: Backend,
    name: str,
    owner: str,
    token: int | None,
    timing: Timing,
    sent: Awaitable[bool] | None = None,
    *,
    lost: LossReason | None = None,
) -> bool:
    """Release ``owner``'s grant, shielded from cancellation and bounded in time.

    ``backend`` is the one the grant was asked of (:func:`adapt` ed for the running
    library, as a :class:`Lease` keeps it).

    Never raises for backend trouble (it is logged): a release must not mask the
    exception that ended the protected block.

    :param sent: the release already sent (:meth:`Backend.release_now`): awaited
        instead of calling :meth:`Backend.release`
    :param lost: why the lease ended, if it was lost: bounds the release more tightly
        (:meth:`Timing.release_bound`)
    """
    bound = timing.release_bound(lost)
    loop = asyncio._get_running_loop()
    bounds = None
    if loop is not None and asyncio.current_task(loop) is not None:
        started = loop.time()  # (current_time())
        bounds = Bounds.of(loop)
    else:
        started = current_time()
    if bounds is None:  # trio: the scope's own deadline
        scope = anyio.CancelScope(deadline=started + bound, shield=True)
    else:  # asyncio: one loop timer for all the releases (aiolease._bounds)
        scope = cancel_scope(shield=True)
        entry = bounds.add(started + bound, scope)
    try:
        with scope:
            try:
                freed = await (backend.release(name, owner, token) if sent is None else sent)
            except BackendError as exc:
                release_failed(name, token, exc, lost)
                freed = False
            if backend.events.observers:
                release_finished(backend, name, token, started, freed)
            return freed
    finally:
        if bounds is not None:
            bounds.done(entry)
    release_timed_out(backend, name, token, bound, started, lost)
    return False


def release_failed(
    name: str, token: int | None, exc: BaseException, lost: LossReason | None = None
) -> None:
    """Log a release that failed (:func:`release_shielded`)."""
    logger.warning(
        "release of lease %r failed: %s (it will expire on its own)",
        name,
        exc,
        extra=log_fields(name, token, lost),
    )


def release_timed_out(
    backend: Backend,
    name: str,
    token: int | None,
    bound: float,
    started: float,
    lost: LossReason | None = None,
) -> None:
    """Log a release cut off by its bound (:func:`release_shielded`), and tell observers."""
    logger.warning(
        "release of lease %r timed out after %gs", name, bound, extra=log_fields(name, token, lost)
    )
    release_finished(backend, name, token, started, False)


def release_finished(
    backend: Backend, name: str, token: int | None, started: float, freed: bool
) -> None:
    backend.events._emit("release_finished", name, token, current_time() - started, freed)


def log_fields(name: str, token: int | None, reason: LossReason | None = None) -> dict[str, object]:
    """The ``extra`` fields of aiolease's log records about one lease: ``aiolease_name``,
    ``aiolease_token`` and ``aiolease_reason`` (a :class:`LossReason` value, or ``None``)."""
    return {
        "aiolease_name": name,
        "aiolease_token": token,
        "aiolease_reason": None if reason is None else reason.value,
    }
