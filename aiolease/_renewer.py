"""One renewal scheduler per backend object, for every lease held through it.

Holding a lease starts no timer of its own. Each held lease registers with the
:class:`Renewer` of its backend: its next renewal time and its local safe deadline
sit in one heap, and one task per backend wakes at the earliest of them. It then

* starts a renewal of every lease that is due, bounded by the renew interval: all of
  them in one :meth:`Backend.renew_many` call from one task, when the backend
  :attr:`~Backend.renews_many`; else each in a task of its own (concurrent calls let
  backends that batch renewals answer them in one round trip); retries failures
  with back-off, as long as the deadline allows; a "not owner" answer ends the lease
  (``STOLEN``);
* ends every lease whose deadline passed, whatever its renewal is doing:
  ``UNREACHABLE`` if a renewal was sent since the last confirmed one (it failed, or
  is still unanswered), else ``EXPIRED`` (none was sent in time: a paused process).

Session backends whose renew is only local bookkeeping (:meth:`Backend.hold`) are
not renewed at all: their leases follow the session's confirmed expiry, and the
scheduler keeps one deadline per session (and margin) for all of them.

The scheduler's task runs in the task group of the backend's *service* when it has
one (:func:`aiolease.open_backend` opens one for as long as the backend is open:
:meth:`Renewer.serve`), so that holding a lease starts no task at all. Otherwise it
runs in the task group of one of the holdings (its *host*), shielded from
cancellations aimed at that holding's caller; when the host's block ends, the task
moves to another holding's task group, and it ends with the last lease. Its state
lives here, not in the task, so a move loses nothing: a renewal interrupted by the
move is due at once again.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import weakref
from collections.abc import Callable, Sequence

import anyio
from anyio.abc import TaskGroup

from ._checked import HeldRenewals
from ._clock import Alarm, current_time, fail_after
from ._exceptions import BackendError, LossReason, NotOwnerError
from ._lease import Lease, log_fields
from ._renewal_state import (
    AsyncioTasks,
    Cohort,
    Counters,
    Group,
    Host,
    Item,
    Renewed,
    RenewerStatistics,
    Renewing,
    Service,
    steady,
    unride,
    unsteady,
)
from ._settling import settle_batch
from .abc import Backend, Grant, RenewedAsAsked, SessionClock

__all__ = ["Renewer", "stop_own_service"]

logger = logging.getLogger("aiolease.renewer")


_renewers: weakref.WeakKeyDictionary[Backend, Renewer] = weakref.WeakKeyDictionary()


def stop_own_service(backend: Backend) -> None:
    """``backend`` closes: stop the service :meth:`Renewer.serve_here` gave its
    scheduler, if any."""
    renewer = _renewers.get(backend)
    if renewer is not None:
        renewer.stop_own_service()


class Renewer:
    """The renewal scheduler of one backend object (see the module docstring)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Item]] = []
        self._seq = itertools.count()
        self._hosts: dict[Host, None] = {}
        self._host: Host | None = None
        self._service: Service | None = None
        self._scope: anyio.CancelScope | None = None
        self._wake: Alarm | None = None  # set to wake the task before ``_wake_at``
        self._wake_at = -math.inf
        #: Whether the task's start is put off until something is due (asyncio, in a
        #: holding), and the loop's timer that starts it then (none: nothing is due).
        self._lazy = False
        self._timer: asyncio.TimerHandle | None = None
        self._dropped_at = -math.inf  # the latest time of an entry _drop_stale dropped
        self._renewing: Renewing = set()  # renewals started by the current task
        self._groups: dict[tuple[int, float], Group] = {}
        self._wakeups = 0
        self._renewals = 0
        self._host_count = 0
        self._leases: dict[Lease, None] = {}
        #: The loop of the service :meth:`serve_here` started (``None``: none, or one
        #: given to :meth:`serve`), and the function that stops it.
        self._own_loop: asyncio.AbstractEventLoop | None = None
        self._own_stop: Callable[[], None] | None = None
        #: Leases to add at the loop's next step (:meth:`add_soon`), and that step's
        #: callback (``None``: none scheduled).
        self._soon: list[tuple[Lease, Counters, SessionClock | None]] = []
        self._soon_handle: asyncio.Handle | None = None
        self._soon_loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def of(cls, backend: Backend) -> Renewer:
        """The scheduler of ``backend`` (made on first use)."""
        renewer = _renewers.get(backend)
        if renewer is None:
            renewer = _renewers[backend] = cls()
        return renewer

    def statistics(self) -> RenewerStatistics:
        """A snapshot of the counters."""
        return RenewerStatistics(
            len(self._leases), self._wakeups, self._renewals, self._host_count, len(self._heap)
        )

    # -- registering ------------------------------------------------------------------

    @property
    def served(self) -> bool:
        """Whether a service task group runs the scheduler (holdings need host nothing)."""
        return self._service is not None

    def serve_here(self) -> bool:
        """Whether the scheduler is served, once this has served it under asyncio with
        plain tasks of the running loop when nothing did (a backend made from its
        class and used without :func:`~aiolease.open_backend`): each block then needs
        no task group of its own (about a third of a block's bookkeeping). Until the
        backend closes (:func:`stop_own_service`), or the loop is not the running one
        any more (its tasks went with it: served again on this one). ``False`` under
        trio, which has no task that outlives its nursery."""
        loop = asyncio._get_running_loop()
        if loop is None or asyncio.current_task(loop) is None:
            return self._service is not None
        if self._service is not None:
            if self._own_loop is None or self._own_loop is loop:
                return True
            self._forget_own_service()  # of a loop that has ended
        self._own_loop = loop
        self._own_stop = self.serve(AsyncioTasks())
        return True

    def _forget_own_service(self) -> None:
        """Drop the service :meth:`serve_here` started on a loop that is not running
        any more, and the task it ran there (gone with its loop)."""
        service, self._service = self._service, None
        if self._host is service and service is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._host = self._scope = self._wake = self._timer = None
            self._lazy = False
            self._wake_at = -math.inf
            self._renewing = set()
        self._own_loop = self._own_stop = None

    def stop_own_service(self) -> None:
        """The backend closes: stop the service :meth:`serve_here` started, if any."""
        stop, self._own_stop, self._own_loop = self._own_stop, None, None
        if stop is not None:
            stop()

    def serve(self, task_group: TaskGroup | AsyncioTasks) -> Callable[[], None]:
        """Run the scheduler's task in ``task_group`` (open as long as the backend is)
        from now on, rather than in the holdings' task groups.

        :returns: the function that ends this service (the backend is closing): every
            lease still held through the backend ends then (``SHUTDOWN``), and the task
            stops
        """
        service = self._service = Service(task_group)
        if self._host is None:
            self._move()

        def stop() -> None:
            if self._service is service:
                self._service = None
                soon, self._soon = self._soon, []
                for lease in [*self._leases, *(lease for lease, _, _ in soon)]:
                    lease._end(LossReason.SHUTDOWN)
            if self._host is service:
                self._stop()
                self._move()

        return stop

    def add(
        self, host: Host | None, lease: Lease, counters: Counters, clock: SessionClock | None
    ) -> None:
        """Keep ``lease`` until it ends; ``host`` may run the scheduler until :meth:`remove`.

        :param host: ``None`` when the scheduler has a service (:attr:`served`)
        :param clock: the session that keeps the lease (:meth:`Backend.hold`), or ``None``
            to renew it
        """
        if host is not None:
            self._hosts[host] = None
        if lease.lost is None:
            self._leases[lease] = None
            if clock is None:
                renewed = Renewed(lease, counters)
                lease._on_end(lambda _: self._forget(renewed))  # forgets the lease too
                self._push(renewed, min(renewed.next_at, lease.deadline))
            else:
                lease._on_end(lambda _: self._leases.pop(lease, None))
                self._join(lease, clock)
        if self._host is None:
            self._move()

    def add_soon(self, lease: Lease, counters: Counters, clock: SessionClock | None) -> bool:
        """:meth:`add` a lease (to renew, or riding on a session's ``clock``) at the
        loop's next step, when the scheduler has a service and runs under asyncio (else
        ``False``: add it now).

        A block's body that awaits anything lets the step come at once (the lease is
        then added while the body waits, off the way between the grant and the body);
        one that ends first ends its lease before: nothing to add, nothing to forget.
        Its deadline still holds meanwhile (:attr:`Lease.lost` reads it), and nothing
        is due so soon after a grant (a renewal comes a renew interval later).
        """
        if self._service is None:
            return False
        loop = asyncio._get_running_loop()
        # (trio-asyncio's ``_get_running_loop`` answers in trio's tasks too, which have
        # no asyncio task: there, as under trio, add at once)
        if loop is None or asyncio.current_task(loop) is None:
            return False
        self._soon.append((lease, counters, clock))
        if self._soon_handle is None or self._soon_loop is not loop:  # (a loop gone)
            self._soon_loop = loop
            self._soon_handle = loop.call_soon(self._add_soon)
        return True

    def _add_soon(self) -> None:
        self._soon_handle = None
        soon, self._soon = self._soon, []
        for lease, counters, clock in soon:
            if lease._reason is None:
                self.add(None, lease, counters, clock)

    def remove(self, host: Host) -> None:
        """``host``'s lease has ended and its block is being left: it can host no more."""
        self._hosts.pop(host, None)
        if self._host is host:
            self._stop()
            self._move()

    def _stop(self) -> None:
        assert self._scope is not None
        if self._lazy:  # never started: nothing to stop
            self._lazy = False
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        elif self._renewing:
            self._scope.cancel()  # the renewals are due again at once, where it moves
        elif self._wake is not None:
            self._wake.set()  # ends the loop: cheaper than a cancellation
        self._host = self._scope = None

    def _move(self) -> None:
        """Run the task in the service, else in any holding's task group, if it runs nowhere."""
        if self._host is None:
            if self._service is not None:
                self._start(self._service)
                return
            for other in self._hosts:
                self._start(other)
                break

    def _join(self, lease: Lease, clock: SessionClock) -> None:
        key = (id(clock), lease.timing.margin)
        group = self._groups.get(key)
        if group is None or group.clock is not clock:
            group = self._groups[key] = Group(clock, lease.timing.margin)
            self._push(group, clock.expires - group.margin)
        group.leases[lease] = None
        lease._on_end(lambda _: self._leave_group(key, group, lease))

    def _leave_group(self, key: tuple[int, float], group: Group, lease: Lease) -> None:
        group.leases.pop(lease, None)
        if not group.leases and self._groups.get(key) is group:
            del self._groups[key]
            group.version += 1  # its heap entry is stale now
            self._drop_stale()

    def _forget(self, renewed: Renewed) -> None:
        renewed.version += 1
        cohort = renewed.cohort
        if cohort is not None:
            cohort.gone += 1
            renewed.cohort = None
        unride(renewed)
        self._leases.pop(renewed.lease, None)
        self._drop_stale()

    def _drop_stale(self) -> None:
        """Drop the heap's stale entries once they may outnumber the live ones.

        An ended lease's entry would otherwise stay until its time came (its next
        renewal: a lease granted and released in a loop grew the heap, and kept each
        lease alive, for a renew interval). Rebuilt in place, as callers may hold the
        list; each rebuild follows as many endings as it keeps entries, so it costs
        O(1) per ending on average, and nothing stays once nothing is held.
        """
        heap = self._heap
        if len(heap) > 2 * (len(self._leases) + len(self._groups)):
            if len(heap) == 1:  # (a lease granted and released alone: the usual case)
                at, _, version, item = heap[0]
                if version != item.version:
                    heap.clear()
                    if at > self._dropped_at:
                        self._dropped_at = at
                return
            live = []
            for entry in heap:
                if entry[2] == entry[3].version:
                    live.append(entry)
                elif entry[0] > self._dropped_at:
                    self._dropped_at = entry[0]
            heap[:] = live
            heapq.heapify(heap)

    # -- the heap ---------------------------------------------------------------------

    def _push(self, item: Item, at: float) -> None:
        item.version += 1
        heapq.heappush(self._heap, (at, next(self._seq), item.version, item))
        if at < self._wake_at:
            self._wake_at = -math.inf  # woken once is enough
            if self._lazy:  # due sooner than the start was put off to
                if self._timer is not None:
                    self._timer.cancel()
                self._start_now()
            if self._wake is not None:
                self._wake.set()

    def _start(self, host: Host) -> None:
        self._host = host
        self._scope = anyio.CancelScope(shield=True)
        if host is not self._service:
            # In a holding's task group, under asyncio: the task starts when something
            # is first due (a timer of the loop's), not now. A block that ends before
            # (most do: a renewal is due a renew interval after the grant) starts no
            # task at all, and its task group has none to wait for. Trio has no timer
            # that could start a task: there, it starts now.
            loop = asyncio._get_running_loop()
            if loop is not None and asyncio.current_task(loop) is not None:
                at = self._next_live()
                self._wake_at = at
                if at > current_time():
                    self._timer = None if at == math.inf else loop.call_at(at, self._start_now)
                    self._lazy = True
                    return
        self._start_now()

    def _start_now(self) -> None:
        """Start the task in its host's task group (from the host's task, or a timer)."""
        self._timer = None
        self._wake_at = -math.inf
        self._lazy = False
        assert self._host is not None and self._scope is not None
        self._host_count += 1
        self._host.task_group.start_soon(self._run, self._scope, name="aiolease renewer")

    async def _run(self, scope: anyio.CancelScope) -> None:
        renewing: Renewing = set()
        self._renewing = renewing
        with scope:
            try:
                # Without a task group while nothing needs renewing (session leases, or
                # leases held for less than a renew interval): cheaper to start and stop.
                if await self._loop(scope, renewing, None):
                    async with anyio.create_task_group() as tg:
                        await self._loop(scope, renewing, tg)
            finally:
                # A renewal cancelled before it started never said so: it is due again.
                for renewed in renewing:
                    if isinstance(renewed, Cohort):  # steady: due again, all of it
                        renewed.in_flight = False
                        self._push(renewed, -math.inf)
                        continue
                    renewed.renewing = False
                    if renewed.lease.lost is None:
                        self._push(renewed, -math.inf)
                renewing.clear()

    async def _loop(
        self, scope: anyio.CancelScope, renewing: Renewing, tg: TaskGroup | None
    ) -> bool:
        """Wake, do what is due, sleep; until the task moves (``False``) or, without a
        task group ``tg``, until a renewal must start (``True``)."""
        while scope is self._scope:  # else it moved to another host
            self._wakeups += 1
            if not self._due(tg, renewing, current_time()):
                return True
            self._wake = wake = Alarm()
            self._wake_at = self._next_live()
            await wake.wait_until(self._wake_at)
            self._wake_at = -math.inf
        return False

    def _due(self, tg: TaskGroup | None, renewing: Renewing, now: float) -> bool:
        """Handle what is due by ``now``; ``False`` if a renewal needs a task group."""
        heap = self._heap
        batch: list[Renewed] | None = None
        cohorts: list[Cohort] = []  # the cohorts due, renewed with the batch
        while heap and heap[0][0] <= now:
            _, _, version, item = heap[0]
            if version != item.version:
                heapq.heappop(heap)
                continue  # moved or forgotten since
            entry = heapq.heappop(heap)
            if isinstance(item, Group):
                self._group_due(item, now)
            elif isinstance(item, Cohort):
                if item.in_flight:
                    self._in_flight_due(item, renewing, now)
                elif tg is None:
                    heapq.heappush(heap, entry)
                    return False
                else:
                    cohorts.append(item)
            elif tg is None and self._renewal_due(item, now):
                heapq.heappush(heap, entry)  # popped first: reading .lost may drop entries
                return False
            else:
                if batch is None and item.lease.backend.renews_many:
                    batch = []
                self._lease_due(tg, renewing, item, now, batch)
        if not (batch or cohorts):
            return True
        assert tg is not None
        batch = [] if batch is None else batch
        self._join_early(batch, cohorts, renewing, now)
        if not batch and len(cohorts) == 1 and steady(cohorts[0], now):
            self._send_steady(tg, cohorts[0], renewing, now)
            return True
        base = self._joinable(batch, cohorts, now) if cohorts else None
        if base is not None:  # the others join its ride: none of its members is touched
            for cohort in cohorts:
                if cohort is not base:
                    self._cohort_due(cohort, renewing, now, batch)
            if batch:
                self._send_joined(tg, base, batch, renewing, now)
            else:  # (the others' members had all ended)
                self._send_steady(tg, base, renewing, now)
            return True
        reuse: Cohort | None = None  # the cohort whose renewals the batch may reuse
        for cohort in cohorts:
            first = not batch
            added = self._cohort_due(cohort, renewing, now, batch)
            if first and added == len(cohort.members) and cohort.renewals is not None:
                reuse = cohort
        if batch:
            self._renewals += len(batch)
            in_flight = Cohort(batch, in_flight=True)
            if reuse is not None and len(batch) == len(reuse.members):
                # Exactly its members, in order: the renewals made for them still hold,
                # and so does the floor of their deadlines.
                in_flight.renewals, in_flight.bound = reuse.renewals, reuse.bound
                in_flight.floor = reuse.floor
            if in_flight.floor > -math.inf:
                self._push(in_flight, in_flight.floor)
            else:
                self._push(in_flight, min(r.lease._deadline for r in batch))
            tg.start_soon(self._renew_many, in_flight, renewing, now)
        return True

    def _next_live(self) -> float:
        """When the task must wake next: the earliest entry still in force.

        Entries of leases released since are dropped from the top first. When none is
        left in force, the task still wakes at the last dropped one's time (here or by
        :meth:`_drop_stale`) rather than at the next grant's push: a backend that grants
        and releases short leases in a row then wakes the task about once per renew
        interval, not once per lease.
        """
        heap = self._heap
        last, self._dropped_at = self._dropped_at, -math.inf
        while heap and heap[0][2] != heap[0][3].version:
            last = max(last, heapq.heappop(heap)[0])
        if heap:
            return heap[0][0]
        return last if last > -math.inf else math.inf

    def _join_early(
        self, batch: list[Renewed], cohorts: list[Cohort], renewing: Renewing, now: float
    ) -> None:
        """Add to ``batch`` the leases due within half their renew interval, and to
        ``cohorts`` the cohorts due then (at least one of them holds one already).

        Renewed a little early, they share this call, and the backend's leases settle
        into one call per renew interval however their grants were spread in time.
        """
        heap = self._heap
        some = batch[0] if batch else cohorts[0].members[0]
        horizon = now + some.lease.timing.renew_interval / 2
        later: list[tuple[float, int, int, Item]] = []
        while heap and heap[0][0] <= horizon:
            entry = heapq.heappop(heap)
            _, _, version, item = entry
            if version != item.version:
                continue  # moved or forgotten since
            if (
                isinstance(item, Renewed)
                and not item.renewing
                and item.next_at - now <= item.lease.timing.renew_interval / 2
                and item.lease._lost_at(now) is None
            ):
                item.renewing = True  # its deadline is the batch's entry's to watch
                renewing.add(item)
                batch.append(item)
            elif isinstance(item, Cohort) and not item.in_flight:
                cohorts.append(item)
            else:
                later.append(entry)
        for entry in later:
            heapq.heappush(heap, entry)

    @staticmethod
    def _renewal_due(renewed: Renewed, now: float) -> bool:
        return (
            renewed.lease._lost_at(now) is None and not renewed.renewing and now >= renewed.next_at
        )

    def _in_flight_due(self, in_flight: Cohort, renewing: Renewing, now: float) -> None:
        """The earliest deadline of a batch still unanswered passed: end the leases
        whose deadline passed; watch the others' next."""
        if in_flight.ride is not None:
            unsteady(in_flight, renewing)
        left = [r for r in in_flight.members if r.renewing and r.lease._lost_at(now) is None]
        if left:
            self._push(in_flight, min(r.lease._deadline for r in left))

    @staticmethod
    def _cohort_due(cohort: Cohort, renewing: Renewing, now: float, batch: list[Renewed]) -> int:
        """Add to ``batch`` the members of ``cohort`` still held and still in it; how many."""
        added = len(batch)
        append = batch.append
        for renewed in cohort.members:
            if renewed.cohort is not cohort:
                continue  # ended, or on an entry of its own since
            renewed.cohort = None
            unride(renewed)
            lease = renewed.lease
            # lease._lost_at(now) is None, without a call while the deadline is ahead:
            if (lease._reason is None and now < lease._deadline) or lease._lost_at(now) is None:
                renewed.renewing = True
                append(renewed)
        renewing.update(batch[added:])  # in one call, not one per lease
        cohort.ride = None
        cohort.joining = 0
        return len(batch) - added

    @staticmethod
    def _joinable(batch: list[Renewed], cohorts: list[Cohort], now: float) -> Cohort | None:
        """The steady cohort (:func:`steady`) that the leases due with it may join: the
        largest one, if every other lease due (in ``batch`` or in another cohort) has
        its timing; else ``None``."""
        base: Cohort | None = None
        for cohort in cohorts:
            if cohort.renewals is not None and steady(cohort, now):
                if base is None or len(cohort.members) > len(base.members):
                    base = cohort
        if base is None:
            return None
        timing = base.timing

        def alike(renewed: Renewed) -> bool:
            other = renewed.lease._timing
            return other is timing or other == timing

        for cohort in cohorts:
            if cohort is base:
                continue
            if cohort.timing is not None:
                if cohort.timing is not timing and cohort.timing != timing:
                    return None
            elif not all(alike(r) for r in cohort.members if r.cohort is cohort):
                return None
        return base if all(alike(r) for r in batch) else None

    def _send_joined(
        self,
        tg: TaskGroup,
        cohort: Cohort,
        joining: list[Renewed],
        renewing: Renewing,
        now: float,
    ) -> None:
        """Renew a steady cohort and ``joining`` (leases of its timing due with it,
        marked as being renewed) in one call, the cohort's own renewals with theirs
        appended: they join its ride when that call renews them all as asked
        (:func:`~aiolease._settling.settle_batch`), else every member is settled one by
        one, as for any batch. A join costs its new members, not the cohort's."""
        ride, held = cohort.ride, cohort.renewals
        assert ride is not None and held is not None
        deadline = ride.deadline
        # A new list (a copy of references), not the cohort's own extended: a call still
        # using that one (a backend's thread after a timeout) sees it unchanged.
        renewals = cohort.renewals = HeldRenewals()
        renewals.extend(held)
        append = renewals.append
        for renewed in joining:
            lease = renewed.lease
            lease._renewal_sent(now)  # (the ride's mark covers its members alone)
            renewed.cohort = cohort  # its entry is the cohort's from now on
            renewed.renewing = False
            append((lease._name, lease._owner, lease._token, lease._timing.ttl))
            if lease._deadline < deadline:
                deadline = lease._deadline
        renewing.difference_update(joining)
        cohort.members.extend(joining)
        cohort.joining += len(joining)
        self._send_steady(tg, cohort, renewing, now, deadline)

    def _send_steady(
        self,
        tg: TaskGroup,
        cohort: Cohort,
        renewing: Renewing,
        now: float,
        deadline: float | None = None,
    ) -> None:
        """Renew a steady cohort (:func:`steady`) as a whole: its members are not
        touched; its ride says that a renewal was sent. ``deadline``: the earliest of
        its members' (``None``: the ride's)."""
        ride = cohort.ride
        assert ride is not None
        ride.unconfirmed = True
        cohort.in_flight = True
        renewing.add(cohort)
        self._renewals += len(cohort.members)
        # Ends them all if no answer comes by then:
        self._push(cohort, ride.deadline if deadline is None else deadline)
        tg.start_soon(self._renew_many, cohort, renewing, now)

    def _group_due(self, group: Group, now: float) -> None:
        deadline = group.clock.expires - group.margin
        if now < deadline:
            self._push(group, deadline)
            return
        for lease in list(group.leases):
            _ = lease.lost  # ends it (the deadline follows the same clock)
        if group.leases:  # a lease granted after the clock's last confirmation
            self._push(group, min(lease.deadline for lease in group.leases))

    def _lease_due(
        self,
        tg: TaskGroup | None,
        renewing: Renewing,
        renewed: Renewed,
        now: float,
        batch: list[Renewed] | None,
    ) -> None:
        """Start the renewal of ``renewed`` if due: in a task of its own, or as part of
        ``batch`` (a backend that :attr:`~Backend.renews_many`)."""
        lease = renewed.lease
        if lease._lost_at(now) is not None:
            return  # ended at its deadline, by reading it, or before
        if tg is not None and not renewed.renewing and now >= renewed.next_at:
            renewed.renewing = True
            renewing.add(renewed)
            if batch is not None:
                batch.append(renewed)
                return  # the batch's entry watches its deadline
            self._renewals += 1
            tg.start_soon(self._renew, renewed, renewing)
        next_at = math.inf if renewed.renewing else renewed.next_at
        self._push(renewed, min(next_at, lease._deadline))

    async def _renew(self, renewed: Renewed, renewing: Renewing) -> None:
        lease = renewed.lease
        timing = lease.timing
        sent_at = current_time()
        lease._renewal_sent()
        result: Grant | BaseException | None = None
        try:
            with fail_after(timing.renew_interval):
                result = await lease.backend.renew(lease.name, lease.owner, lease.token, timing.ttl)
        except Exception as exc:
            result = exc
        finally:
            # Also when the scheduler moves (``None``): the renewal is due again at once.
            now = current_time()
            if type(result) is Grant and lease._events.observers:
                lease._events._emit("renewed", (lease,), now - sent_at)
            self._settle(renewed, renewing, sent_at, result, now)

    async def _renew_many(self, in_flight: Cohort, renewing: Renewing, sent_at: float) -> None:
        """Renew every lease of the batch (one backend's) in one call, sent at ``sent_at``
        (the time the batch was made: no await comes in between)."""
        batch = in_flight.members
        backend = batch[0].lease.backend
        renewals = in_flight.renewals
        steady = in_flight.ride is not None  # (its ride was marked sent: _send_steady)
        if renewals is None:
            renewals = in_flight.renewals = HeldRenewals()
            for renewed in batch:
                lease = renewed.lease
                if not steady:
                    lease._renewal_sent(sent_at)
                renewals.append((lease._name, lease._owner, lease._token, lease._timing.ttl))
            in_flight.bound = min({r.lease._timing.renew_interval: None for r in batch})
        elif not steady:
            for renewed in batch:
                lease = renewed.lease
                if lease._reason is None and sent_at < lease._deadline:
                    lease._unconfirmed = True  # lease._renewal_sent(sent_at), inlined
                else:
                    lease._renewal_sent(sent_at)
        results: Sequence[Grant | BaseException | None] = [None] * len(batch)
        bound = in_flight.bound
        try:
            with fail_after(bound):
                answers = await backend.renew_many(renewals)
            if len(answers) != len(batch):
                raise BackendError(f"{len(answers)} answers to {len(batch)} renewals")
            results = answers
        except Exception as exc:  # every lease of the batch failed alike
            results = [exc] * len(batch)
        finally:
            in_flight.version += 1  # its entry is stale now
            now = current_time()
            events = batch[0].lease._events
            if events.observers:
                if type(results) is RenewedAsAsked:
                    failed = results.failed
                    confirmed = [r.lease for i, r in enumerate(batch) if i not in failed]
                else:
                    confirmed = [
                        r.lease for r, a in zip(batch, results, strict=True) if type(a) is Grant
                    ]
                if confirmed:
                    events._emit("renewed", confirmed, now - sent_at)
            settle_batch(in_flight, renewing, sent_at, results, now, self._push, self._settle)

    def _settle(
        self,
        renewed: Renewed,
        renewing: Renewing,
        sent_at: float,
        result: Grant | BaseException | None,
        now: float | None = None,
    ) -> None:
        """Apply the outcome of one renewal sent at ``sent_at`` (``None``: interrupted),
        at ``now`` (the current time, if the caller read it)."""
        lease = renewed.lease
        if isinstance(result, Grant):
            renewed.counters.renewals += 1
            lease._confirm(sent_at, result)
            renewed.backoff = renewed.first_backoff
            renewed.next_at = lease._renew_at
        elif isinstance(result, NotOwnerError):
            lease._end(LossReason.STOLEN)
        elif isinstance(result, BackendError | TimeoutError):
            self._failed(renewed, result)
        elif result is not None:  # a backend bug must not end other leases' holdings
            logger.error(
                "renewal of lease %r raised",
                lease.name,
                exc_info=result,
                extra=log_fields(lease.name, lease.token),
            )
            self._failed(renewed, result)
        renewed.renewing = False
        renewing.discard(renewed)
        if lease._lost_at(current_time() if now is None else now) is None:
            self._push(renewed, min(renewed.next_at, lease._deadline))

    def _failed(self, renewed: Renewed, exc: BaseException) -> None:
        lease = renewed.lease
        renewed.counters.renew_failures += 1
        lease._note_error(exc)
        logger.info(
            "renewal of lease %r failed, retrying: %r",
            lease.name,
            exc,
            extra=log_fields(lease.name, lease.token),
        )
        if lease._events.observers:
            lease._events._emit("renew_failed", lease, exc)
        renewed.next_at = current_time() + renewed.backoff
        renewed.backoff = min(renewed.backoff * 2, lease.timing.renew_interval)
