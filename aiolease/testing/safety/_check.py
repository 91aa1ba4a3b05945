"""The checker: what the records of one run prove.

It trusts nothing it can recompute. Given the workers' records, the fence's log
and the windows during which the controller kept a process stopped, it counts:

* **overlaps**: pairs of bodies of different grants whose ``[start, stop]``
  intervals intersect (touching ends do not count). In the read-write form, a pair
  of two readers is no overlap: only pairs with a writer count. In the semaphore
  form (``limit`` given), an overlap is a body whose start brings more than
  ``limit`` bodies running at once. A body whose process was
  stopped between the start of its acquire and its stop can legitimately overlap
  (it could not stop while frozen): such pairs are counted apart, as
  ``paused_overlaps``, and there the fence must protect the resource. A process
  whose fence write was kept waiting by a stopped one (that was stopped holding the
  fence's lock) counts as stopped for that long (see :func:`frozen_windows`).
* **stale writes accepted**: an accepted fenced write whose token is lower than a token
  accepted before it in the fence's log, or lower than the token of a body that
  had finished registering (its first write came back accepted) before this write
  was sent. The second rule uses only the workers' clocks, not the fence.
* **stale writes rejected**: writes the fence refused (the fence working).
* **token order**: bodies, in start order, whose token is not greater than every
  earlier body's (paused bodies excepted, as above). In the semaphore and
  read-write forms bodies run side by side and may record their starts out of
  grant order, so there it is: bodies whose token is not greater than that of
  every body that stopped before their acquire began, plus bodies that share a
  token with another body.
* **bad stops**: a body that stopped with another exception than
  :class:`~aiolease.LeaseLostError` after a loss, a loss that did not surface as
  ``LeaseLostError``, an unexpected error, or a body that never reported stopping.
* **kills**: a process the controller killed (``SIGKILL``) cannot report how its
  last body ended; that body is taken to have run until the kill (its outcome is
  ``killed``, no bad stop), so a successor that started before the kill overlaps it.
* **losses**: bodies whose lease the core ended for another reason than a release.
* **worst stop latency**: the longest time from the core ending a lease (not by
  release) to its body stopping.

Disagreements between the fence and the records are listed in ``problems``.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from ._records import Accepted, Hold, Pause, Records, Write

__all__ = ["KILLED", "Findings", "check", "cut_at_kills", "frozen_windows"]

_RELEASED = "released"
#: The outcome of a body whose process was killed while it ran.
KILLED = "killed"


@dataclass(frozen=True, slots=True)
class Findings:
    """What :func:`check` found in one run's records."""

    acquisitions: int
    losses: int
    overlaps: int
    paused_overlaps: int
    stale_accepted: int
    stale_rejected: int
    token_order: int
    bad_stops: int
    worst_stop_latency: float | None
    problems: tuple[str, ...]


def _stop_of(hold: Hold, writes: Sequence[Write]) -> float:
    """The stop of a body, or the last sign of life of one that never reported it."""
    if hold.stop is not None:
        return hold.stop
    ends = [w.end for w in writes if w.pid == hold.pid and w.token == hold.token]
    return max([hold.start, *ends])


def frozen_windows(pauses: Sequence[Pause], writes: Sequence[Write]) -> list[Pause]:
    """The controller's pauses, and the waits they imposed on other processes.

    A process stopped in the middle of a fence write keeps the fence locked, so
    another process's write waits until it wakes: that process was frozen too, for
    as long as its write was still waiting when a pause ended.
    """
    waits = [
        Pause(w.pid, w.begin, w.end)
        for w in writes
        for p in pauses
        if w.pid != p.pid and w.begin < p.end <= w.end
    ]
    return [*pauses, *waits]


def cut_at_kills(holds: Sequence[Hold], kills: Mapping[int, float]) -> Iterator[Hold]:
    """``holds``, with the last body of each killed process ending at its kill.

    :param kills: when the controller killed which process (``time.monotonic()``)
    """
    for hold in holds:
        at = kills.get(hold.pid)
        if at is None or hold.outcome is not None or hold.start > at:
            yield hold
        else:
            yield replace(hold, stop=at if hold.stop is None else hold.stop, outcome=KILLED)


def _paused(hold: Hold, stop: float, pauses: Sequence[Pause]) -> bool:
    return any(p.pid == hold.pid and p.begin < stop and p.end > hold.attempt for p in pauses)


def count_overlaps(
    holds: Sequence[Hold], writes: Sequence[Write], pauses: Sequence[Pause]
) -> tuple[int, int]:
    """``(overlaps, paused_overlaps)``: intersecting bodies of different grants
    (two readers of the read-write form may intersect)."""
    spans = sorted((h.start, _stop_of(h, writes), h) for h in holds)
    overlaps = paused = 0
    for i, (_, stop_a, a) in enumerate(spans):
        for start_b, stop_b, b in spans[i + 1 :]:
            if start_b >= stop_a:
                break  # sorted by start: no later body can reach back into a
            if (a.pid, a.token) == (b.pid, b.token) or a.mode == b.mode == "read":
                continue
            if _paused(a, stop_a, pauses) or _paused(b, stop_b, pauses):
                paused += 1
            else:
                overlaps += 1
    return overlaps, paused


def count_excess(
    holds: Sequence[Hold], writes: Sequence[Write], pauses: Sequence[Pause], limit: int
) -> tuple[int, int]:
    """``(overlaps, paused_overlaps)`` of the semaphore form: starts that bring more
    than ``limit`` bodies running at once, counting only bodies whose process was
    never stopped (overlaps), or counting them too (paused overlaps, allowed).
    """
    # At one instant a stop sorts before a start: touching ends do not count.
    events = sorted(
        [(h.start, 1, h) for h in holds] + [(_stop_of(h, writes), 0, h) for h in holds],
        key=lambda e: (e[0], e[1]),
    )
    running = free = overlaps = paused = 0  # all bodies; bodies never stopped
    for _, starts, h in events:
        unpaused = not _paused(h, _stop_of(h, writes), pauses)
        step = 1 if starts else -1
        running += step
        free += step if unpaused else 0
        if not starts:
            continue
        if free > limit and unpaused:
            overlaps += 1
        elif running > limit:
            paused += 1
    return overlaps, paused


def count_permit_order(holds: Sequence[Hold], writes: Sequence[Write]) -> int:
    """Token-order violations among permits: a token shared by two bodies, or not
    above that of every body that stopped before this one's acquire began."""
    seen: dict[int, int] = {}
    for h in holds:
        seen[h.token] = seen.get(h.token, 0) + 1
    violations = sum(n - 1 for n in seen.values())
    stopped = sorted((_stop_of(h, writes), h.token) for h in holds)
    stops = [stop for stop, _ in stopped]
    best: list[int] = []
    for _, token in stopped:
        best.append(max(best[-1], token) if best else token)
    for h in holds:
        n = bisect.bisect_left(stops, h.attempt)  # bodies stopped before h asked
        if n and best[n - 1] >= h.token:
            violations += 1
    return violations


def count_token_order(
    holds: Sequence[Hold], writes: Sequence[Write], pauses: Sequence[Pause]
) -> int:
    """Bodies, in start order, whose token does not exceed every earlier body's."""
    highest: int | None = None
    violations = 0
    for hold in sorted(holds, key=lambda h: h.start):
        if _paused(hold, _stop_of(hold, writes), pauses):
            continue
        if highest is not None and hold.token <= highest:
            violations += 1
        highest = hold.token if highest is None else max(highest, hold.token)
    return violations


def stale_accepted(writes: Sequence[Write], log: Sequence[Accepted]) -> int:
    """Accepted writes that a correct fence would have refused (see the module docs)."""
    stale: set[object] = set()
    highest = 0
    for entry in sorted(log, key=lambda e: e.seq):
        if entry.fenced and entry.token < highest:
            stale.add(entry.seq)
        highest = max(highest, entry.token)
    registered = sorted((w.end, w.token) for w in writes if w.register and w.accepted)
    ends = [end for end, _ in registered]
    best: list[int] = []
    for _, token in registered:
        best.append(max(best[-1], token) if best else token)
    for w in writes:
        if not w.accepted or not w.fenced:
            continue
        n = bisect.bisect_left(ends, w.begin)  # registrations that ended before w was sent
        if n and best[n - 1] > w.token:
            stale.add(w.seq if w.seq is not None else (w.pid, w.token, w.begin))
    return len(stale)


def bad_stop(hold: Hold) -> str | None:
    """Why this body's end breaks the rules, or ``None``."""
    lost = hold.reason is not None and hold.reason != _RELEASED
    if hold.outcome == KILLED:
        return None  # it could not say: see cut_at_kills
    if hold.stop is None or hold.outcome is None:
        return "never reported stopping"
    if hold.outcome == "error":
        return f"stopped with {hold.error}" + (f" after a loss ({hold.reason})" if lost else "")
    if lost and hold.outcome != "lost":
        return f"lost ({hold.reason}) but left the block without LeaseLostError"
    if hold.outcome == "lost" and not lost:
        return "raised LeaseLostError although the core never ended the lease"
    return None


def stop_latency(hold: Hold) -> float | None:
    """Seconds from the core ending the lease (not a release) to the body stopping."""
    if hold.reason in (None, _RELEASED) or hold.ended_at is None or hold.stop is None:
        return None
    return max(hold.stop - hold.ended_at, 0.0)


def _fence_problems(
    records: Records, log: Sequence[Accepted], rejections: int, kills: Mapping[int, float]
) -> list[str]:
    """How the workers' records and the fence disagree. A process killed while it
    wrote may have had its last write taken by the fence (logged, or refused) before
    it could record the answer: one such write per killed process is no
    disagreement (its last in the fence's log, with no write of its recorded after)."""
    problems: list[str] = []
    logged = {(e.seq, e.pid, e.token) for e in log}
    recorded = {(w.seq, w.pid, w.token) for w in records.writes if w.accepted}
    if recorded - logged:
        problems.append(f"{len(recorded - logged)} accepted writes are missing from the fence log")
    last = {e.pid: e for e in sorted(log, key=lambda e: e.seq)}
    latest: dict[int, float] = {}
    for w in records.writes:
        latest[w.pid] = max(latest.get(w.pid, w.begin), w.begin)
    in_flight = {
        (e.seq, e.pid, e.token)
        for e in last.values()
        if e.pid in kills
        and (e.seq, e.pid, e.token) not in recorded
        and latest.get(e.pid, e.at) <= e.at
    }
    unrecorded = logged - recorded - in_flight
    if unrecorded:
        problems.append(f"{len(unrecorded)} fence log entries no worker recorded")
    fenced: dict[int | None, bool] = {e.seq: e.fenced for e in log}
    if any(fenced.get(w.seq, w.fenced) != w.fenced for w in records.writes if w.accepted):
        problems.append("the workers and the fence log disagree on which writes were fenced")
    refused = sum(1 for w in records.writes if not w.accepted)
    if not refused <= rejections <= refused + len(kills) - len(in_flight):
        problems.append(f"workers saw {refused} rejections, the fence counted {rejections}")
    return problems


def check(
    records: Records,
    log: Sequence[Accepted],
    rejections: int,
    pauses: Sequence[Pause] = (),
    *,
    limit: int | None = None,
    kills: Mapping[int, float] | None = None,
) -> Findings:
    """Check one run.

    :param records: what the workers recorded
    :param log: the fence's log of accepted writes
    :param rejections: the fence's own count of rejected writes
    :param pauses: when the controller kept which process stopped
    :param limit: the semaphore form's limit (``None``: a lock, an election, or a
        read-write lock, told apart by the bodies' ``mode``)
    :param kills: when the controller killed which process (see :func:`cut_at_kills`)
    """
    holds = tuple(cut_at_kills(records.holds, kills or {}))
    writes = records.writes
    pauses = frozen_windows(pauses, writes)
    permits = limit is not None or any(h.mode is not None for h in holds)
    if limit is not None:
        overlaps, paused = count_excess(holds, writes, pauses, limit)
    else:
        overlaps, paused = count_overlaps(holds, writes, pauses)
    if permits:
        token_order = count_permit_order(holds, writes)
    else:
        token_order = count_token_order(holds, writes, pauses)
    bad = [(h, why) for h in holds if (why := bad_stop(h)) is not None]
    latencies = [x for h in holds if (x := stop_latency(h)) is not None]
    problems = [*records.problems, *_fence_problems(records, log, rejections, kills or {})]
    problems += [f"pid {h.pid} token {h.token}: {why}" for h, why in bad[:5]]
    return Findings(
        acquisitions=len(holds),
        losses=sum(1 for h in holds if h.reason not in (None, _RELEASED)),
        overlaps=overlaps,
        paused_overlaps=paused,
        stale_accepted=stale_accepted(writes, log),
        stale_rejected=sum(1 for w in writes if not w.accepted),
        token_order=token_order,
        bad_stops=len(bad),
        worst_stop_latency=max(latencies, default=None),
        problems=tuple(problems),
    )
