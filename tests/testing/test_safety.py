"""The safety harness: its checker, its fence, and short real runs with faults.

The runs start real OS processes that contend for one lease; the workers run on
the event loop the test runs on (asyncio or trio). The long version is
``python -m aiolease.testing.safety --url ... --long``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import pytest

from aiolease import AsyncLock, InvalidArgument, open_backend
from aiolease.testing.safety import (
    Accepted,
    Fault,
    Fence,
    Hold,
    Pause,
    Records,
    SafetyReport,
    Write,
    assert_safe,
    check,
    main,
    read_records,
    run_safety,
)
from aiolease.testing.safety._faults import Injector
from aiolease.testing.safety._hosted import HostedServer

#: Short runs: a few seconds each. The margin is wider than the library's default
#: (50 ms here) because a holder starved of CPU for longer than its margin on a
#: busy machine really would overlap: that is what the margin is for.
SHORT: dict[str, Any] = {
    "ttl": 0.5,
    "margin": 0.15,
    "processes": 4,
    "fault_every": 0.05,  # faults start early, and end while the others still contend
    "fault_length": 0.75,
}
#: Seconds per run: long enough for three pauses, or one blackhole.
DURATION = {Fault.NONE: 1.5, Fault.SIGSTOP: 2.5, Fault.SIGKILL: 2.5, Fault.BLACKHOLE: 2.0}

# -- the checker, on hand-made records ------------------------------------------------------


def hold(pid: int, token: int, start: float, stop: float | None, **kw: Any) -> Hold:
    """A body that was released normally unless ``kw`` says otherwise."""
    fields: dict[str, Any] = {"attempt": start - 0.01, "outcome": "released"}
    fields.update({"reason": "released", "ended_at": stop, **kw})
    return Hold(pid, token, start=start, stop=stop, **fields)


def writes_of(*holds: Hold, fenced: bool = True) -> list[Write]:
    """Each body's registering write, accepted, in the order given."""
    return [
        Write(h.pid, h.token, h.start - 0.005, h.start - 0.001, True, seq, True, fenced)
        for seq, h in enumerate(holds, 1)
    ]


def log_of(writes: list[Write]) -> list[Accepted]:
    return [Accepted(w.seq or 0, w.pid, w.token, w.end, w.fenced) for w in writes if w.accepted]


def checked(
    holds: list[Hold],
    writes: list[Write],
    pauses: list[Pause] | None = None,
    limit: int | None = None,
) -> Any:
    rejections = sum(1 for w in writes if not w.accepted)
    records = Records(tuple(holds), tuple(writes), 0, ())
    return check(records, log_of(writes), rejections, pauses or [], limit=limit)


def test_clean_records_are_clean() -> None:
    holds = [hold(1, 1, 0.0, 1.0), hold(2, 2, 1.0, 2.0), hold(1, 3, 2.5, 3.0)]
    found = checked(holds, writes_of(*holds))
    assert found.acquisitions == 3
    assert (found.overlaps, found.paused_overlaps, found.stale_accepted) == (0, 0, 0)
    assert (found.token_order, found.bad_stops, found.problems) == (0, 0, ())


def test_an_overlap_is_caught() -> None:
    holds = [hold(1, 1, 0.0, 1.0), hold(2, 2, 0.9, 2.0), hold(3, 3, 2.0, 3.0)]
    found = checked(holds, writes_of(*holds))
    assert (found.overlaps, found.paused_overlaps) == (1, 0)  # touching ends do not count


def test_an_overlap_explained_by_a_pause_is_counted_apart() -> None:
    holds = [hold(1, 1, 0.0, 1.5), hold(2, 2, 0.9, 2.0)]
    found = checked(holds, writes_of(*holds), [Pause(1, 0.5, 1.4)])
    assert (found.overlaps, found.paused_overlaps) == (0, 1)
    # A pause of another process, or outside the body, explains nothing.
    found = checked(holds, writes_of(*holds), [Pause(3, 0.5, 1.4), Pause(1, 1.6, 2.0)])
    assert (found.overlaps, found.paused_overlaps) == (1, 0)


def test_a_process_kept_waiting_by_a_paused_one_counts_as_paused() -> None:
    """Process 1 is stopped holding the fence's lock; 2 and 3 are granted meanwhile,
    their registrations wait for 1 to wake, and 3 gets through first."""
    holds = [
        hold(1, 5, 0.0, 1.6, attempt=-0.02),
        hold(2, 6, 1.65, 1.7, attempt=0.55),
        hold(3, 7, 1.62, 2.5, attempt=0.75),
    ]
    writes = [
        Write(1, 5, -0.01, 1.55, True, 1, register=True),
        Write(3, 7, 0.8, 1.61, True, 2, register=True),
        Write(2, 6, 0.6, 1.64, False, None, register=True),
    ]
    found = checked(holds, writes, [Pause(1, 0.5, 1.5)])
    assert (found.overlaps, found.token_order, found.stale_accepted) == (0, 0, 0)
    assert found.paused_overlaps == 1  # 2 and 3
    found = checked(holds, writes)  # no pause: the same records are violations
    assert (found.overlaps, found.token_order) == (1, 1)


def test_a_body_that_never_reported_stopping_is_a_bad_stop() -> None:
    holds = [hold(1, 1, 0.0, None, outcome=None), hold(2, 2, 1.0, 2.0)]
    writes = [*writes_of(*holds), Write(1, 1, 1.1, 1.2, True, 3)]
    found = checked(holds, writes)
    assert found.bad_stops == 1
    assert found.overlaps == 1  # it lived at least until its last write
    assert any("never reported stopping" in p for p in found.problems)


def test_a_killed_body_runs_until_the_kill() -> None:
    """Killed in its body, process 1 never reports stopping: its body lasts until the
    kill (no bad stop), so a successor that started before the kill overlaps it."""
    holds = [hold(1, 1, 0.0, None, outcome=None), hold(2, 2, 1.0, 2.0)]
    writes = [*writes_of(*holds), Write(1, 1, 0.4, 0.5, True, 3)]
    rejections = 0
    records = Records(tuple(holds), tuple(writes), 0, ())
    found = check(records, log_of(writes), rejections, kills={1: 1.2})
    assert (found.overlaps, found.bad_stops, found.problems) == (1, 0, ())
    found = check(records, log_of(writes), rejections, kills={1: 0.9})
    assert (found.overlaps, found.bad_stops, found.token_order) == (0, 0, 0)
    found = check(records, log_of(writes), rejections, kills={2: 0.9})  # another one
    assert found.bad_stops == 1


def test_a_stale_write_accepted_after_a_higher_one_in_the_log_is_caught() -> None:
    holds = [hold(1, 1, 0.0, 1.0), hold(2, 2, 1.0, 2.0)]
    writes = [*writes_of(*holds), Write(1, 1, 1.5, 1.6, True, 3)]
    found = checked(holds, writes)
    assert found.stale_accepted == 1


def test_a_stale_write_is_caught_from_the_clocks_alone() -> None:
    """The fence's log says nothing wrong (it lost token 2's entry), the records do."""
    holds = [hold(1, 1, 0.0, 1.0), hold(2, 2, 1.0, 2.0)]
    writes = [*writes_of(*holds), Write(1, 1, 1.5, 1.6, True, 3)]
    records = Records(tuple(holds), tuple(writes), 0, ())
    log = [e for e in log_of(writes) if e.token != 2]
    found = check(records, log, 0)
    assert found.stale_accepted == 1
    assert found.problems == ("1 accepted writes are missing from the fence log",)


def test_rejected_stale_writes_are_counted_and_compared_with_the_fence() -> None:
    holds = [hold(1, 1, 0.0, 1.0), hold(2, 2, 1.0, 2.0)]
    writes = [*writes_of(*holds), Write(1, 1, 1.5, 1.6, False)]
    found = checked(holds, writes)
    assert (found.stale_accepted, found.stale_rejected, found.problems) == (0, 1, ())
    records = Records(tuple(holds), tuple(writes), 0, ())
    assert check(records, log_of(writes), 5).problems == (
        "workers saw 1 rejections, the fence counted 5",
    )


def test_a_write_taken_by_the_fence_as_its_writer_was_killed_is_no_disagreement() -> None:
    """A worker killed between the fence's commit and its own record of the answer
    leaves one fence entry (or one refusal) that no worker recorded: excused for its
    last write only, and only if the controller killed it (a CI run failed on it)."""
    holds = [hold(1, 1, 0.0, 1.0), hold(2, 2, 1.0, None, outcome=None, reason=None)]
    writes = writes_of(*holds)
    log = [*log_of(writes), Accepted(3, 2, 2, 1.5, True)]  # pid 2's second write
    records = Records(tuple(holds), tuple(writes), 0, ())
    unrecorded = "1 fence log entries no worker recorded"
    assert check(records, log, 0, kills={2: 1.6}).problems == ()
    assert unrecorded in check(records, log, 0).problems  # pid 2 was not killed
    assert unrecorded in check(records, log, 0, kills={1: 1.6}).problems
    # Only its last: an earlier write it never recorded is a disagreement.
    two = [*log, Accepted(4, 2, 2, 1.55, True)]
    assert check(records, two, 0, kills={2: 1.6}).problems == (unrecorded,)
    # A write it recorded after the unrecorded entry: that entry was not in flight.
    later = Records(tuple(holds), (*writes, Write(2, 2, 1.52, 1.53, False)), 0, ())
    assert check(later, log, 1, kills={2: 1.6}).problems == (unrecorded,)
    # A refusal it never recorded, one per killed process.
    assert check(records, log_of(writes), 1, kills={2: 1.6}).problems == ()
    assert check(records, log_of(writes), 2, kills={2: 1.6}).problems == (
        "workers saw 0 rejections, the fence counted 2",
    )
    assert check(records, log, 1, kills={2: 1.6}).problems == (
        "workers saw 0 rejections, the fence counted 1",
    )


def test_a_token_regression_is_caught() -> None:
    holds = [hold(1, 5, 0.0, 1.0), hold(2, 4, 1.0, 2.0), hold(3, 6, 2.0, 3.0)]
    assert checked(holds, writes_of(*holds)).token_order == 1
    same = [hold(1, 5, 0.0, 1.0), hold(2, 5, 1.0, 2.0)]
    assert checked(same, writes_of(*same)).token_order == 1


def test_a_paused_body_is_not_held_to_the_token_order() -> None:
    """Granted token 5, frozen before its body started; token 6 ran meanwhile."""
    holds = [hold(2, 6, 1.0, 2.0), hold(1, 5, 2.5, 2.6, attempt=0.0)]
    assert checked(holds, writes_of(*holds)).token_order == 1
    assert checked(holds, writes_of(*holds), [Pause(1, 0.5, 2.4)]).token_order == 0


# -- the semaphore and read-write forms --------------------------------------------------


def test_more_bodies_than_the_limit_at_once_are_caught() -> None:
    """Three permits run together during [0.8, 1.0]: one too many for a limit of 2."""
    holds = [hold(1, 1, 0.0, 1.0), hold(2, 2, 0.5, 2.0), hold(3, 3, 0.8, 1.5)]
    writes = writes_of(*holds, fenced=False)
    found = checked(holds, writes, limit=2)
    assert (found.overlaps, found.paused_overlaps, found.token_order) == (1, 0, 0)
    assert checked(holds, writes, limit=3).overlaps == 0
    # Touching ends do not count: the third starts as the first stops.
    touching = [hold(1, 1, 0.0, 1.0), hold(2, 2, 0.5, 2.0), hold(3, 3, 1.0, 1.5)]
    assert checked(touching, writes_of(*touching, fenced=False), limit=2).overlaps == 0


def test_more_bodies_than_the_limit_explained_by_a_pause_are_counted_apart() -> None:
    holds = [hold(1, 1, 0.0, 1.0), hold(2, 2, 0.5, 2.0), hold(3, 3, 0.8, 1.5)]
    writes = writes_of(*holds, fenced=False)
    found = checked(holds, writes, [Pause(1, 0.2, 0.9)], limit=2)
    assert (found.overlaps, found.paused_overlaps) == (0, 1)
    found = checked(holds, writes, [Pause(4, 0.2, 0.9)], limit=2)  # another process
    assert (found.overlaps, found.paused_overlaps) == (1, 0)


def test_permits_may_start_out_of_token_order_but_never_share_or_regress() -> None:
    """Concurrent permits record their starts in any order; a token given twice, or one
    below that of a body stopped before its acquire began, is a violation."""
    side_by_side = [hold(1, 2, 0.0, 1.0), hold(2, 1, 0.1, 1.0)]
    writes = writes_of(*side_by_side, fenced=False)
    assert checked(side_by_side, writes, limit=2).token_order == 0
    shared = [hold(1, 2, 0.0, 1.0), hold(2, 2, 0.1, 1.0)]
    assert checked(shared, writes_of(*shared, fenced=False), limit=2).token_order == 1
    regress = [hold(1, 5, 0.0, 1.0), hold(2, 4, 1.5, 2.0, attempt=1.2)]
    assert checked(regress, writes_of(*regress, fenced=False), limit=2).token_order == 1


def test_unfenced_writes_are_never_stale() -> None:
    """A semaphore's permits write side by side with their own tokens: a lower token
    after a higher one is no stale write."""
    holds = [hold(1, 1, 0.0, 1.0), hold(2, 2, 0.5, 1.5)]
    writes = [*writes_of(*holds, fenced=False), Write(1, 1, 0.7, 0.71, True, 3, fenced=False)]
    found = checked(holds, writes, limit=2)
    assert (found.stale_accepted, found.problems) == (0, ())


def test_readers_may_overlap_but_a_writer_with_a_reader_is_caught() -> None:
    readers = [
        hold(1, 1, 0.0, 1.0, mode="read"),
        hold(2, 2, 0.5, 1.5, mode="read"),
        hold(3, 3, 1.5, 2.0, mode="write"),
    ]
    found = checked(readers, writes_of(*readers))
    assert (found.overlaps, found.token_order) == (0, 0)
    with_a_reader = [hold(1, 1, 0.0, 1.0, mode="read"), hold(2, 2, 0.9, 1.5, mode="write")]
    assert checked(with_a_reader, writes_of(*with_a_reader)).overlaps == 1
    two_writers = [hold(1, 1, 0.0, 1.0, mode="write"), hold(2, 2, 0.9, 1.5, mode="write")]
    assert checked(two_writers, writes_of(*two_writers)).overlaps == 1
    paused = checked(with_a_reader, writes_of(*with_a_reader), [Pause(1, 0.2, 0.8)])
    assert (paused.overlaps, paused.paused_overlaps) == (0, 1)


def test_a_stale_writer_after_a_reader_is_caught() -> None:
    """A reader registered token 3 (unfenced, it raises the fence); then the writer of
    token 2 wrote, and a fence let it through."""
    writer, reader = hold(1, 2, 0.0, 2.0, mode="write"), hold(2, 3, 1.0, 1.5, mode="read")
    writes = [
        Write(1, 2, -0.005, -0.001, True, 1, register=True),
        Write(2, 3, 0.9, 0.95, True, 2, register=True, fenced=False),
        Write(1, 2, 1.2, 1.21, True, 3),
    ]
    assert checked([writer, reader], writes).stale_accepted == 1
    writes[-1] = Write(1, 2, 1.2, 1.21, False)  # refused, as the fence does
    found = checked([writer, reader], writes)
    assert (found.stale_accepted, found.stale_rejected) == (0, 1)


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"outcome": "error", "error": "ValueError: x", "reason": "expired"}, "after a loss"),
        ({"outcome": "released", "reason": "stolen"}, "without LeaseLostError"),
        ({"outcome": "lost", "reason": "released"}, "never ended the lease"),
        ({"outcome": "error", "error": "BackendError: x", "reason": "released"}, "stopped with"),
    ],
)
def test_bad_stops_are_caught(fields: dict[str, Any], why: str) -> None:
    holds = [hold(1, 1, 0.0, 1.0, **fields)]
    found = checked(holds, writes_of(*holds))
    assert found.bad_stops == 1
    assert why in found.problems[0]


def test_stop_latency_runs_from_the_loss_to_the_stop() -> None:
    holds = [
        hold(1, 1, 0.0, 1.0, outcome="lost", reason="expired", ended_at=0.997),
        hold(2, 2, 1.5, 2.0, outcome="lost", reason="stolen", ended_at=2.5),  # stopped first
        hold(3, 3, 2.5, 3.0, ended_at=2.0),  # released: no loss to measure from
    ]
    found = checked(holds, writes_of(*holds))
    assert found.bad_stops == 0
    assert found.worst_stop_latency == pytest.approx(0.003)


def test_records_are_read_back_and_joined(tmp_path: Path) -> None:
    lines = [
        {"kind": "write", "pid": 7, "token": 3, "begin": 1.0, "end": 1.1, "accepted": True,
         "seq": 1, "register": True},
        {"kind": "start", "pid": 7, "token": 3, "attempt": 0.5, "start": 1.2},
        {"kind": "stop", "pid": 7, "token": 3, "stop": 2.0},
        {"kind": "end", "pid": 7, "token": 3, "reason": "expired", "at": 1.99},
        {"kind": "outcome", "pid": 7, "token": 3, "outcome": "lost", "error": "LeaseLostError"},
        {"kind": "acquire_error", "pid": 7, "error": "TimeoutError", "at": 2.5},
    ]  # fmt: skip
    path = tmp_path / "worker-0.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"kind": "wri')
    records = read_records([path, tmp_path / "missing.jsonl"])
    assert records.holds == (Hold(7, 3, 0.5, 1.2, 2.0, "lost", "LeaseLostError", "expired", 1.99),)
    assert records.writes == (Write(7, 3, 1.0, 1.1, True, 1, True),)
    assert records.acquire_errors == 1
    assert len(records.problems) == 1 and "unreadable" in records.problems[0]


def test_a_lease_that_ended_before_its_body_started_is_no_problem(tmp_path: Path) -> None:
    """A holder paused between its grant and its body: its loss callback writes "end"
    before the body writes "start" (a MongoDB rw run once failed on this); and a lease
    that ended before any body ran has an "end" and an "outcome" but no "start"."""
    lines = [
        {"kind": "end", "pid": 7, "token": 3, "reason": "expired", "at": 1.1},
        {"kind": "start", "pid": 7, "token": 3, "attempt": 0.5, "start": 1.2},
        {"kind": "stop", "pid": 7, "token": 3, "stop": 1.3},
        {"kind": "outcome", "pid": 7, "token": 3, "outcome": "lost", "error": "LeaseLostError"},
        {"kind": "end", "pid": 7, "token": 4, "reason": "expired", "at": 2.0},
        {"kind": "outcome", "pid": 7, "token": 4, "outcome": "lost", "error": "LeaseLostError"},
        {"kind": "stop", "pid": 7, "token": 5, "stop": 3.0},
    ]  # fmt: skip
    path = tmp_path / "worker-0.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = read_records([path])
    assert records.holds == (Hold(7, 3, 0.5, 1.2, 1.3, "lost", "LeaseLostError", "expired", 1.1),)
    assert len(records.problems) == 1 and "stop of a body that never started" in records.problems[0]


# -- the fence ----------------------------------------------------------------------------


def test_the_fence_rejects_lower_tokens_and_logs_in_order(tmp_path: Path) -> None:
    with Fence(tmp_path / "fence.db") as a, Fence(tmp_path / "fence.db") as b:
        answers = [a.write(1, 3), a.write(1, 3), b.write(2, 2), b.write(2, 4), a.write(1, 3)]
        assert [w.accepted for w in answers] == [True, True, False, True, False]
        assert [w.seq for w in answers] == [1, 2, None, 3, None]
        assert [(e.seq, e.pid, e.token) for e in a.log()] == [(1, 1, 3), (2, 1, 3), (3, 2, 4)]
        assert b.rejections() == 2


def test_unfenced_writes_are_accepted_and_raise_the_fence(tmp_path: Path) -> None:
    with Fence(tmp_path / "fence.db") as fence:
        answers = [fence.write(1, 5), fence.write(2, 3, fenced=False), fence.write(1, 4)]
        assert [w.accepted for w in answers] == [True, True, False]
        fence.write(2, 7, fenced=False)
        assert fence.highest() == 7 and not fence.write(1, 6).accepted
        assert [(e.token, e.fenced) for e in fence.log()] == [(5, True), (3, False), (7, False)]


# -- the report ---------------------------------------------------------------------------


def test_the_summary_line_and_verdict() -> None:
    clean = SafetyReport("sqlite", Fault.SIGSTOP, runs=1, acquisitions=5, faults=2)
    dirty = SafetyReport("sqlite", Fault.SIGSTOP, runs=1, acquisitions=3, overlaps=1)
    assert clean.ok and not dirty.ok
    both = clean + dirty
    assert (both.runs, both.acquisitions, both.faults, both.overlaps) == (2, 8, 2, 1)
    line = both.line()
    assert line.startswith("safety sqlite  sigstop")
    assert "runs=2 acquisitions=8 losses=0 faults=2 overlaps=1 " in line
    assert "worst_stop_latency=-" in line
    na = SafetyReport.not_applicable("sqlite", Fault.BLACKHOLE, "no network")
    assert na.ok and na.line().endswith("n/a (no network)")
    with pytest.raises(ValueError):
        clean + SafetyReport("memory", Fault.SIGSTOP)
    broken = SafetyReport("memory", Fault.NONE, worst_stop_latency=0.0031, errors=("crash",))
    assert not broken.ok and broken.line().endswith("worst_stop_latency=3.10ms errors=1")


# -- real runs ----------------------------------------------------------------------------


async def short_run(
    url: str, fault: Fault, loop: str, workdir: Path, **options: Any
) -> SafetyReport:
    """A short run whose workers run on ``loop`` (the test's own event loop).

    The records stay in ``workdir`` (pytest keeps the last few), to study a failure.
    """
    asyncio_or_trio: Literal["asyncio", "trio"] = "trio" if loop == "trio" else "asyncio"
    options = {**SHORT, "duration": DURATION[fault], **options}
    return await run_safety(url, fault=fault, loop=asyncio_or_trio, workdir=workdir, **options)


# The runs below each start four worker processes: each runs on one loop, the loops
# taking turns (docs/testing.md, "Keeping the suite short"), and none is fault-free
# (every run checks that no bodies overlap outside a pause).


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_the_election_form_is_safe(tmp_path: Path, anyio_backend: str) -> None:
    """Workers hold terms of ``Elector.leadership()`` (what an election-only backend
    is run with) instead of ``async with AsyncLock``: the same records, the same checks."""
    url = f"sqlite:///{tmp_path / 'leases.db'}"
    report = await short_run(url, Fault.SIGSTOP, anyio_backend, tmp_path / "records", election=True)
    assert_safe(report, min_acquisitions=2)


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_sqlite_is_safe(tmp_path: Path, anyio_backend: str) -> None:
    url = f"sqlite:///{tmp_path / 'leases.db'}"
    report = await short_run(url, Fault.SIGSTOP, anyio_backend, tmp_path / "records")
    assert_safe(report)
    check_fence_worked(report)


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_memory_is_safe(tmp_path: Path, anyio_backend: str) -> None:
    report = await short_run("memory://", Fault.SIGSTOP, anyio_backend, tmp_path)
    assert_safe(report)
    check_fence_worked(report)


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_sqlite_is_safe_when_the_holder_is_killed(tmp_path: Path, anyio_backend: str) -> None:
    """Holders are killed (``SIGKILL``) while three or more workers live: two kills of
    four. The others take over once the dead holder's ttl has run out (the harness
    fails a run in which no other body started after a kill), and the killed workers'
    exits are no errors."""
    url = f"sqlite:///{tmp_path / 'leases.db'}"
    report = await short_run(url, Fault.SIGKILL, anyio_backend, tmp_path / "records")
    assert_safe(report)
    assert report.faults == 2, report.line()


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_memory_is_safe_when_the_holder_is_cut_off(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Each worker reaches the server through its own proxy; the holder's is blackholed.

    The fault hits a holder right after its grant, and bodies outlast the ttl, so
    the holder surely loses its lease while cut off and must stop in time.
    """
    report = await short_run(
        "memory://", Fault.BLACKHOLE, anyio_backend, tmp_path, fault_aim="fresh", hold=(1.2, 2.0)
    )
    assert_safe(report)
    assert report.losses >= 1 and report.worst_stop_latency is not None, report.line()


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_the_semaphore_form_is_safe(tmp_path: Path, anyio_backend: str) -> None:
    """Four workers hold permits of a semaphore of limit 2 while holders are paused:
    never more than two bodies at once outside a pause, tokens unique and increasing."""
    report = await short_run("memory://", Fault.SIGSTOP, anyio_backend, tmp_path, limit=2)
    assert_safe(report)
    assert report.losses >= 1 and report.paused_overlaps >= 1, report.line()


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_read_write_form_is_safe(tmp_path: Path, anyio_backend: str) -> None:
    """Four workers read or write a read-write lock while holders (writers first) are
    paused: a writer never runs with anyone outside a pause."""
    url = f"sqlite:///{tmp_path / 'leases.db'}"
    report = await short_run(url, Fault.SIGSTOP, anyio_backend, tmp_path / "records", rw=True)
    assert_safe(report)
    assert report.losses >= 1, report.line()


@pytest.mark.slow
def test_a_backend_that_ignores_the_limit_is_caught(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'leases.db'}"
    args = ["--url", url, "--backend-factory", "tests.testing.broken_backends:IgnoresLimit"]
    args += ["--fault", "none", "--limit", "2"]
    args += ["--duration", "1.5", "--ttl", "0.5", "--processes", "4"]
    assert main(args) == 1
    line = capsys.readouterr().out.strip()
    assert line.startswith("safety IgnoresLimit none")
    overlaps = re.search(r" overlaps=(\d+) ", line)
    assert overlaps is not None and int(overlaps.group(1)) > 0, line


def check_fence_worked(report: SafetyReport) -> None:
    """The pauses froze holders in their bodies while others took over, and the fence
    rejected what they wrote on waking up.

    A body spends most of its time in blocking work between taking its token and
    writing with it (see :mod:`aiolease.testing.safety._worker`), so a pause almost
    always freezes it there, and then its stale write on waking is certain. A pause
    can also land at a checkpoint (the core may then cancel the body first), or, on
    SQLite, while the holder is inside a transaction that keeps the others out until
    it wakes; three pauses per run make a run without any rejection very rare.
    """
    assert report.faults >= 2 and report.losses >= 1, report.line()
    assert report.paused_overlaps >= 1 and report.stale_rejected >= 1, report.line()


@pytest.mark.slow
def test_a_backend_that_ignores_ttl_is_caught(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'leases.db'}"
    args = [
        "--url",
        url,
        "--backend-factory",
        "tests.testing.broken_backends:IgnoresTtl",
        "--fault",
        "none",
    ]
    args += ["--duration", "1.5", "--ttl", "0.5", "--processes", "4"]
    assert main(args) == 1
    line = capsys.readouterr().out.strip()
    assert line.startswith("safety IgnoresTtl none")
    overlaps = re.search(r" overlaps=(\d+) ", line)
    assert overlaps is not None and int(overlaps.group(1)) > 0, line


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("url", "fault", "why"),
    [
        ("sqlite:///{tmp}/l.db", Fault.BLACKHOLE, "no network"),
        ("sqlite:///{tmp}/l.db", Fault.SERVER_RESTART, "no server"),
        ("memory://", Fault.SERVER_RESTART, "forgets its tokens"),
    ],
)
async def test_faults_that_do_not_apply_say_so(
    tmp_path: Path, url: str, fault: Fault, why: str
) -> None:
    report = await run_safety(url.format(tmp=tmp_path), fault=fault, duration=1)
    assert not report.applicable and why in report.reason
    assert report.acquisitions == 0 and " n/a (" in report.line()


@pytest.mark.anyio
async def test_etcd_leader_kill_needs_an_etcd_cluster(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="etcd cluster URL"):
        await run_safety(f"sqlite:///{tmp_path}/l.db", fault=Fault.ETCD_LEADER_KILL)
    with pytest.raises(InvalidArgument, match="etcd cluster URL"):
        await run_safety("etcd://127.0.0.1:2379", fault="etcd-leader-kill")


@pytest.mark.anyio
@pytest.mark.parametrize(
    "kwargs",
    [
        {"fault": "gc-pause"},
        {"processes": 1},
        {"duration": 1, "rounds": 2},
        {"rounds": 0},
        {"ttl": 0},
        {"ttl": 1, "margin": 1},
        {"backend_factory": "no_such_module:Backend"},
        {"limit": 0},
        {"limit": 5, "processes": 5},
        {"limit": 2, "rw": True},
        {"rw": True, "election": True},
    ],
)
async def test_bad_arguments_are_refused(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        await run_safety(f"sqlite:///{tmp_path}/l.db", **kwargs)


def test_the_command_exits_2_on_misuse_and_0_for_n_a(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path}/l.db"
    assert main(["--url", url, "--fault", "etcd-leader-kill"]) == 2
    assert "etcd cluster URL" in capsys.readouterr().err
    assert main(["--url", url, "--fault", "blackhole", "--fault", "server-restart"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in out] == ["blackhole", "server-restart"]
    assert all(" n/a (" in line for line in out)


@pytest.mark.anyio
async def test_server_restart_of_a_hosted_memory_server(tmp_path: Path, anyio_backend: str) -> None:
    """The restart machinery works, and shows why the fault is n/a for memory://."""
    server = HostedServer("memory://", tmp_path / "server.err", loop=anyio_backend)
    await server.start()
    try:
        port = server.port
        async with open_backend(server.url()) as backend:
            lock = AsyncLock(backend, "job", ttl=5)
            for _ in range(3):
                async with lock as lease:
                    before = lease.token
            injector = Injector(
                Fault.SERVER_RESTART, backend, "job", [], every=0, length=0, server=server
            )
            await injector.inject_once()
            assert server.port == port
            assert [e.fault for e in injector.events] == [Fault.SERVER_RESTART]
        async with open_backend(server.url()) as backend:
            async with AsyncLock(backend, "job", ttl=5) as lease:
                assert lease.token <= before  # the new server started its tokens again
    finally:
        await server.aclose()
