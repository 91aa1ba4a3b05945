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

import logging
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NoReturn, final

import anyio

from ._clock import current_time
from ._exceptions import (
    BackendError,
    BackendUnavailable,
    InvalidArgument,
    LossReason,
    NotOwnerError,
    lost_error,
)
from ._validate import check_seconds
from .abc import Backend, Grant, SessionClock

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

logger = logging.getLogger("aiolease")

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
    def build(
        cls,
        ttl: object,
        renew_interval: object = None,
        margin: object = None,
        release_timeout: object = None,
    ) -> Self:
        """Validate and fill in defaults.

        :raises InvalidArgument: ``ttl <= 0``, or the renew interval does not fit
            in ``ttl - margin``
        """
        ttl_s = check_seconds("ttl", ttl)
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

    def deadline_after(self, sent_at: float, grant: Grant) -> float:
        """The local safe deadline for a grant confirmed by a request sent at ``sent_at``."""
        return effective_sent(sent_at, grant) + min(self.ttl, grant.ttl) - self.margin

    def renewal_after(self, sent_at: float, grant: Grant) -> float:
        """When to renew a grant confirmed by a request sent at ``sent_at``: a renew
        interval after the confirmation's effective send time, shortened in proportion
        when the server granted less than the ttl asked for."""
        good_for = min(self.ttl, grant.ttl)
        return effective_sent(sent_at, grant) + self.renew_interval * min(good_for / self.ttl, 1.0)


def effective_sent(sent_at: float, grant: Grant) -> float:
    """The earlier of the core's own send time and the backend's :attr:`Grant.sent_at`."""
    return sent_at if grant.sent_at is None else min(sent_at, grant.sent_at)


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
    ) -> None:
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
        self._deadline = timing.deadline_after(sent_at, grant)
        self._next_renewal = timing.renewal_after(sent_at, grant)
        self._clock: SessionClock | None = None
        self._acquired_at = sent_at
        self._reason: LossReason | None = None
        self._ended: anyio.Event | None = None  # made by wait_lost(), on first use
        self._on_end: list[Callable[[LossReason], object]] = []
        self._last_error: BaseException | None = None
        self._renewals = 0
        self._warned = False

    def __repr__(self) -> str:
        state = self._reason.value if self._reason else f"{self.remaining():.3f}s left"
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
        return self._deadline

    @property
    def lost(self) -> LossReason | None:
        """Why the lease ended, or ``None`` while it is held.

        Reading this after the deadline reports :attr:`LossReason.EXPIRED` even if
        the watchdog has not woken up yet.
        """
        if self._reason is None and current_time() >= self._deadline:
            error = self._last_error
            if self._clock is not None:
                self._follow_clock()
                error = error or self._clock.error
            if current_time() >= self._deadline:
                # Refused connections mean UNREACHABLE; unanswered renewals mean EXPIRED.
                unreachable = isinstance(error, BackendUnavailable)
                self._end(LossReason.UNREACHABLE if unreachable else LossReason.EXPIRED)
        return self._reason

    def _follow_clock(self) -> None:
        assert self._clock is not None
        self._deadline = max(self._deadline, self._clock.expires - self._timing.margin)

    def remaining(self) -> float:
        """Seconds left before the local safe deadline (0 once lost)."""
        if self.lost is not None:
            return 0.0
        return max(self._deadline - current_time(), 0.0)

    async def wait_lost(self) -> LossReason:
        """Wait until the lease ends and return why."""
        while (reason := self.lost) is None:
            if self._ended is None:
                self._ended = anyio.Event()
            with anyio.move_on_at(self._deadline):
                await self._ended.wait()
        return reason

    async def renew(self) -> None:
        """Renew once now (``async with`` and electors do this for you).

        :raises LeaseLostError: the lease is lost, or the backend no longer has it
        :raises BackendError: the renewal failed; the lease stays valid until its deadline
        """
        self._raise_if_lost()
        sent_at = current_time()
        try:
            grant = await self._backend.renew(
                self._name, self._owner, self._token, self._timing.ttl
            )
        except NotOwnerError:
            self._end(LossReason.STOLEN)
            self._raise_if_lost()
            raise
        except BackendError as exc:
            self._last_error = exc
            raise
        self.confirm(sent_at, grant)

    async def release(self) -> bool:
        """Release the lease: shielded, bounded by the release timeout, idempotent.

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
            logger.warning("release of lease %r after it was lost (%s)", self._name, reason.value)
        # Even a lost lease may still sit on the server; the owner check makes this safe.
        freed = await release_shielded(
            self._backend, self._name, self._owner, self._token, self._timing
        )
        return freed and reason is None

    # -- used by the keepalive and the context managers -------------------------------

    def confirm(self, sent_at: float, grant: Grant) -> None:
        """Record a confirmed renewal sent at ``sent_at``; never moves the deadline back."""
        if self._reason is None:
            self._deadline = max(self._deadline, self._timing.deadline_after(sent_at, grant))
            self._next_renewal = self._timing.renewal_after(sent_at, grant)
            self._last_error = None
            self._renewals += 1

    def next_renewal(self) -> float:
        """When the last confirmation says to renew next (see :meth:`Timing.renewal_after`)."""
        return self._next_renewal

    def follow(self, clock: SessionClock) -> None:
        """From now on, the deadline follows ``clock`` (the session that keeps the grant,
        :meth:`Backend.hold`): ``clock.expires - margin``, never earlier than it is."""
        self._clock = clock

    def note_error(self, exc: BaseException) -> None:
        """Remember a failed renewal: if the deadline passes after a refused connection
        (:class:`BackendUnavailable`) the reason is UNREACHABLE, else EXPIRED."""
        self._last_error = exc

    def on_end(self, callback: Callable[[LossReason], object]) -> None:
        """Call ``callback(reason)`` when the lease ends (at once if it has)."""
        if self._reason is not None:
            callback(self._reason)
        else:
            self._on_end.append(callback)

    def _end(self, reason: LossReason) -> None:
        if self._reason is not None:
            return
        self._reason = reason
        if reason is not LossReason.RELEASED:
            logger.warning("lease %r (token %d) lost: %s", self._name, self._token, reason.value)
        if self._ended is not None:
            self._ended.set()
        callbacks, self._on_end = self._on_end, []
        for callback in callbacks:
            callback(reason)

    def end(self, reason: LossReason) -> None:
        """Mark the lease ended with ``reason`` (first reason wins)."""
        self._end(reason)

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
        return self._renewals


async def release_shielded(
    backend: Backend,
    name: str,
    owner: str,
    token: int | None,
    timing: Timing,
    sent: Awaitable[bool] | None = None,
) -> bool:
    """Release ``owner``'s grant, shielded from cancellation and bounded in time.

    ``backend`` is the one the grant was asked of (:func:`adapt` ed for the running
    library, as a :class:`Lease` keeps it).

    Never raises for backend trouble (it is logged): a release must not mask the
    exception that ended the protected block.

    :param sent: the release already sent (:meth:`Backend.release_now`): awaited
        instead of calling :meth:`Backend.release`
    """
    with anyio.CancelScope(deadline=current_time() + timing.release_timeout, shield=True):
        try:
            if sent is not None:
                return await sent
            return await backend.release(name, owner, token)
        except BackendError as exc:
            logger.warning("release of lease %r failed: %s (it will expire on its own)", name, exc)
            return False
    logger.warning("release of lease %r timed out after %gs", name, timing.release_timeout)
    return False
