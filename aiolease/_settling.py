"""How the renewal scheduler (:mod:`aiolease._renewer`) applies the answer to one
batch of renewals sent in one :meth:`~aiolease.abc.Backend.renew_many` call: the
leases confirmed alike form a cohort (one heap entry), due at their next renewal
time; the others are settled one by one by the scheduler."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._lease import Ride, Timing
from ._renewal_state import Cohort, Item, Renewed, Renewing, unsteady
from .abc import Grant, RenewedAsAsked

__all__ = ["settle_batch"]

#: The scheduler's heap push: an item due at a time.
Push = Callable[[Item, float], None]
#: The scheduler's settling of one lease's renewal (sent at, outcome, now).
Settle = Callable[[Renewed, Renewing, float, "Grant | BaseException | None", float], None]


def settle_batch(
    in_flight: Cohort,
    renewing: Renewing,
    sent_at: float,
    results: Sequence[Grant | BaseException | None],
    now: float,
    push: Push,
    settle: Settle,
) -> None:
    """Apply the answers to one batch; the leases confirmed alike form a cohort
    (one heap entry) due at their next renewal time, the others get entries of
    their own (``settle``)."""
    batch = in_flight.members
    as_asked = type(results) is RenewedAsAsked and results.renewals is in_flight.renewals
    if in_flight.ride is not None:
        if as_asked and _settle_steady(in_flight, renewing, sent_at, results, now, push):
            return
        unsteady(in_flight, renewing)  # then settled as any batch
    if as_asked:
        assert type(results) is RenewedAsAsked
        _settle_as_asked(in_flight, renewing, sent_at, results, now, push, settle)
        return
    cohorts: dict[float, list[Renewed]] = {}
    # What a confirmation means depends only on the timing and the grant: worked
    # out once for the leases that share both (locks share equal timings).
    seen: tuple[Timing, float, float | None] | None = None
    deadline = renew_at = 0.0
    for renewed, result in zip(batch, results, strict=True):
        lease = renewed.lease
        if type(result) is not Grant or lease._reason is not None:
            settle(renewed, renewing, sent_at, result, now)
            continue
        renewed.counters.renewals += 1
        timing = lease._timing
        if (
            seen is None
            or seen[0] is not timing
            or seen[1] != result.ttl
            or seen[2] != result.sent_at
        ):
            seen = (timing, result.ttl, result.sent_at)
            deadline = timing._deadline_after(sent_at, result)
            renew_at = timing._renewal_after(sent_at, result)
        lease._confirm_at(deadline, renew_at)
        renewed.backoff = renewed.first_backoff
        renewed.next_at = next_at = lease._renew_at
        renewed.renewing = False
        renewing.discard(renewed)
        if lease._lost_at(now) is None:
            members = cohorts.get(next_at)
            if members is None:
                members = cohorts[next_at] = []
            members.append(renewed)
    for next_at, members in cohorts.items():
        cohort = Cohort(members, in_flight=False)
        for renewed in members:
            renewed.cohort = cohort
        push(cohort, next_at)


def _settle_steady(
    cohort: Cohort,
    renewing: Renewing,
    sent_at: float,
    results: Sequence[Grant | BaseException | None],
    now: float,
    push: Push,
) -> bool:
    """Settle a steady cohort renewed as asked, all of it, by updating its ride alone;
    ``False`` (and nothing done) if it is not that simple: a renewal failed, a member
    ended meanwhile, or their deadline passed before the answer came."""
    ride, timing = cohort.ride, cohort.timing
    assert type(results) is RenewedAsAsked and ride is not None and timing is not None
    if results.failed or cohort.gone:
        return False
    grant = Grant(cohort.members[0].lease._token, timing.ttl, results.sent_at)
    deadline = max(ride.deadline, timing._deadline_after(sent_at, grant))
    if now >= deadline:
        return False
    ride.deadline = cohort.floor = deadline
    ride.renew_at = renew_at = timing._renewal_after(sent_at, grant)
    ride.unconfirmed = False
    ride.renewals += 1
    if cohort.joining:
        _join_ride(cohort, ride)
    cohort.in_flight = False
    renewing.discard(cohort)
    push(cohort, renew_at)
    return True


def _join_ride(cohort: Cohort, ride: Ride) -> None:
    """The members joining ``cohort`` (its last ``joining``) were renewed as asked with
    it: they ride on its ``ride`` from now on, their renewal counts offset by the
    confirmations it counted before this one (which were not theirs)."""
    counted = ride.renewals - 1
    for renewed in cohort.members[-cohort.joining :]:
        lease = renewed.lease
        lease._unconfirmed = False  # (the ride's confirmation is theirs now)
        lease._renewals -= counted
        lease._ride = ride
        renewed.counters._ride(ride, counted)
        renewed.backoff = renewed.first_backoff
    cohort.joining = 0


def _settle_as_asked(
    in_flight: Cohort,
    renewing: Renewing,
    sent_at: float,
    results: RenewedAsAsked,
    now: float,
    push: Push,
    settle: Settle,
) -> None:
    """:func:`settle_batch` for an answer that says "all renewed as asked, but
    these": no :class:`Grant` per lease. Each renewal asked its lease's own ttl (the
    core made them), so a confirmation means the same for all the leases of one
    timing: worked out once per timing."""
    batch = in_flight.members
    failed = results.failed
    grant_sent = results.sent_at
    cohorts: dict[float, list[Renewed]] = {}
    floors: dict[float, float] = {}  # per cohort, the earliest deadline given
    # Per cohort, the timing of its members if they share one (equal), else None:
    timings: dict[float, Timing | None] = {}
    timing: Timing | None = None
    deadline = renew_at = 0.0
    members: list[Renewed] = []
    for index, renewed in enumerate(batch):
        lease = renewed.lease
        if lease._reason is not None or (failed and index in failed):
            settle(renewed, renewing, sent_at, results[index], now)
            continue
        renewed.counters.renewals += 1
        if lease._timing is not timing:
            timing = lease._timing
            grant = Grant(lease._token, timing.ttl, grant_sent)
            deadline = timing._deadline_after(sent_at, grant)
            renew_at = timing._renewal_after(sent_at, grant)
            members = cohorts.setdefault(renew_at, [])
            floors[renew_at] = min(floors.get(renew_at, deadline), deadline)
            shared = timings.setdefault(renew_at, timing)
            if shared is not None and shared is not timing and shared != timing:
                timings[renew_at] = None
        # lease._confirm_at(deadline, renew_at), inlined (once per lease per tick):
        if deadline > lease._deadline:
            lease._deadline = deadline
        lease._renew_at = renew_at
        lease._unconfirmed = False
        lease._renewals += 1
        renewed.backoff = renewed.first_backoff
        renewed.next_at = renew_at
        renewed.renewing = False
        if now < lease._deadline or lease._lost_at(now) is None:
            members.append(renewed)
    renewing.difference_update(batch)  # settled, all of them: in one call
    for next_at, members in cohorts.items():
        if not members:
            continue
        cohort = Cohort(members, in_flight=False)
        cohort.floor = floors[next_at]
        if len(members) == len(batch):  # all of them, in order: the same renewals
            cohort.renewals, cohort.bound = in_flight.renewals, in_flight.bound
        shared = timings[next_at]
        ride = None if shared is None else Ride(cohort.floor, next_at)
        cohort.ride, cohort.timing = ride, shared
        for renewed in members:
            renewed.cohort = cohort
            if ride is not None:  # from now on, it reads its renewal state there
                renewed.lease._ride = ride
                renewed.counters._ride(ride)
        push(cohort, next_at)
