"""What the renewal scheduler (:mod:`aiolease._renewer`) keeps: per lease, per session
and per cohort of leases renewed together; the counters and statistics behind
``statistics()``; and what runs its task (a host, a service, plain asyncio tasks).

A *cohort* is leases renewed in one :meth:`~aiolease.abc.Backend.renew_many` call with
one heap entry for all of them; a *steady* cohort (its members share one timing and
none has ended) is renewed as a whole, its answer recorded once on the members'
shared :class:`~aiolease._lease.Ride`, not per lease.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from anyio.abc import TaskGroup

from ._checked import HeldRenewals
from ._exceptions import LossReason
from ._lease import Lease, Ride, Timing
from .abc import SessionClock

__all__ = [
    "AsyncioTasks",
    "Cohort",
    "Counters",
    "Group",
    "Host",
    "Item",
    "Renewed",
    "RenewerStatistics",
    "Renewing",
    "Service",
    "first_backoff",
    "steady",
    "unride",
    "unsteady",
]


class Counters:
    """Mutable counters behind the frozen ``statistics()`` snapshots.

    ``renewals`` counts those of its leases that ride on a :class:`Ride` lazily: as
    many times the ride's count as it has leases on it, until they leave it.
    """

    __slots__ = ("_renewals", "_riding", "acquisitions", "losses", "renew_failures")

    def __init__(self) -> None:
        self.acquisitions = 0
        self._renewals = 0
        self.renew_failures = 0
        self.losses: dict[LossReason, int] = {}
        #: The rides its leases are on, and how many of them on each.
        self._riding: dict[Ride, int] = {}

    @property
    def renewals(self) -> int:
        return self._renewals + sum(ride.renewals * n for ride, n in self._riding.items())

    @renewals.setter
    def renewals(self, value: int) -> None:
        self._renewals += value - self.renewals

    def lost(self, reason: LossReason) -> None:
        self.losses[reason] = self.losses.get(reason, 0) + 1

    def _ride(self, ride: Ride, counted: int = 0) -> None:
        """One more of its leases rides on ``ride``, from when the ride had counted
        ``counted`` confirmations (0: since it was made)."""
        self._renewals -= counted  # (those are not its lease's)
        self._riding[ride] = self._riding.get(ride, 0) + 1

    def _left(self, ride: Ride, renewals: int) -> None:
        """One of its leases left ``ride``, having counted ``renewals`` on it."""
        self._renewals += renewals
        left = self._riding[ride] - 1
        if left:
            self._riding[ride] = left
        else:
            del self._riding[ride]


class Host(Protocol):
    """What can run the scheduler's task: a holding, while its block runs."""

    @property
    def task_group(self) -> TaskGroup | AsyncioTasks: ...


class AsyncioTasks:
    """Starts plain asyncio tasks: a "task group" that is not bound to the task that
    made it, for a backend that one task opens and another closes (pytest-asyncio's
    fixtures, aiohttp's cleanup contexts). The scheduler's task ends by itself when
    its service stops; a task still running when the loop closes is cancelled by it."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def start_soon(
        self, func: Callable[..., Awaitable[Any]], *args: object, name: object = None
    ) -> None:
        task = asyncio.ensure_future(func(*args))
        if name is not None:
            task.set_name(str(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class Service:
    """Open as long as the backend is: the scheduler's preferred host."""

    __slots__ = ("task_group",)

    def __init__(self, task_group: TaskGroup | AsyncioTasks) -> None:
        self.task_group = task_group


@dataclass(frozen=True)
class RenewerStatistics:
    """What one backend's scheduler did so far (for tests and tuning).

    :param leases: leases registered now
    :param wakeups: times its task woke up
    :param renewals: renewals it started
    :param hosts: tasks it ran in so far (one per move between holdings)
    :param entries: entries in its heap: at most one per lease or session registered
        now, plus fewer stale ones (of leases ended since) than those
    """

    leases: int
    wakeups: int
    renewals: int
    hosts: int
    entries: int = 0


class Renewed:
    """One lease that the scheduler renews."""

    __slots__ = (
        "backoff",
        "cohort",
        "counters",
        "first_backoff",
        "lease",
        "next_at",
        "renewing",
        "version",
    )

    def __init__(self, lease: Lease, counters: Counters) -> None:
        self.lease = lease
        self.counters = counters
        self.next_at = lease._next_renewal()
        self.backoff = self.first_backoff = first_backoff(lease)
        self.renewing = False
        self.version = 0
        #: The cohort whose heap entry stands for this lease's (``None``: its own entry).
        self.cohort: Cohort | None = None


class Group:
    """The leases riding on one session clock with one margin: one deadline for all."""

    __slots__ = ("clock", "leases", "margin", "version")

    def __init__(self, clock: SessionClock, margin: float) -> None:
        self.clock = clock
        self.margin = margin
        self.leases: dict[Lease, None] = {}
        self.version = 0


class Cohort:
    """Leases renewed together in one :meth:`Backend.renew_many` call, with one heap
    entry for all of them (none of their own meanwhile), so that renewing N leases
    costs no heap operation per lease:

    * while the call is *in flight*, the entry sits at the earliest deadline among
      them, to end those whose deadline passes before the answer comes;
    * once answered alike (confirmed, with the same next renewal time), at that time:
      they are then due, and renewed, together again.

    Its ``renewals`` (the call's argument, and the shortest renew interval among them)
    are made once and handed to every call that renews exactly its members again, as
    long as none of them ends or is answered apart: a backend may keep what it derives
    from them (:attr:`HeldRenewals.cache`) for the next tick. So is its ``floor``: no
    member's deadline is earlier (deadlines only move later), so the call's entry may
    sit there rather than at a minimum taken over the members on every tick.

    A cohort whose members share one timing also shares their renewal state (its
    ``ride``, which every member's lease reads lazily): as long as none of them ends
    (``gone``), the cohort itself is renewed again, tick after tick, and an answer that
    renews all of them as asked updates the ride alone, not each lease (a *steady*
    cohort: nothing per lease per tick). Leases of the same timing due with it are sent
    in the same call and join its ride when that call is confirmed (``joining``), so
    that a join costs only its new members.
    """

    __slots__ = (
        "bound",
        "floor",
        "gone",
        "in_flight",
        "joining",
        "members",
        "renewals",
        "ride",
        "timing",
        "version",
    )

    def __init__(
        self,
        members: list[Renewed],
        *,
        in_flight: bool,
        renewals: HeldRenewals | None = None,
        bound: float = math.inf,
    ) -> None:
        self.members = members
        self.in_flight = in_flight
        self.version = 0
        self.renewals = renewals
        self.bound = bound
        self.floor = -math.inf
        #: Members that ended since it was made (while it has a ride).
        self.gone = 0
        #: How many of its last members are joining its ride: sent with the steady
        #: cohort, they join the ride when that renewal is confirmed as asked
        #: (:meth:`~aiolease._renewer.Renewer._send_joined`); 0 when none are.
        self.joining = 0
        #: The renewal state its members share, and their one timing (``None``: none).
        self.ride: Ride | None = None
        self.timing: Timing | None = None


Item = Renewed | Group | Cohort
#: What the scheduler's task has started renewing: leases, and steady cohorts.
Renewing = set[Renewed | Cohort]


def first_backoff(lease: Lease) -> float:
    return min(0.05, lease.timing.renew_interval / 4)


def steady(cohort: Cohort, now: float) -> bool:
    """Whether ``cohort`` may be renewed as a whole: it has a ride, none of its members
    ended since it was made, and their deadline is ahead."""
    ride = cohort.ride
    return ride is not None and cohort.gone == 0 and now < ride.deadline


def unsteady(cohort: Cohort, renewing: Renewing) -> None:
    """A steady cohort in flight becomes a batch like any other: each member still in
    it leaves the ride and is marked as being renewed (the rare path: a member ended,
    a renewal failed, or no answer came in time)."""
    for renewed in cohort.members:
        if renewed.cohort is cohort:
            renewed.cohort = None
            unride(renewed)
            renewed.renewing = True
            renewing.add(renewed)
    cohort.ride = None
    cohort.joining = 0
    renewing.discard(cohort)


def unride(renewed: Renewed) -> None:
    """Take ``renewed``'s lease off its ride, if it has one (:meth:`Lease._leave_ride`)."""
    lease = renewed.lease
    ride = lease._ride
    if ride is not None:
        renewed.counters._left(ride, lease._leave_ride())
        renewed.next_at = lease._renew_at
