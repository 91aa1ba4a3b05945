"""run_at_most_once and run_every: a job runs at most once per interval across "machines"
(two backend objects on one SQLite file, as two processes of a host would open it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path

import anyio
import pytest

import aiolease
from aiolease import Lease, LeaseLostError, LossReason, run_at_most_once, run_every
from aiolease.abc import Backend
from aiolease.testing.memory import DrivenMemoryBackend

pytestmark = pytest.mark.anyio

WAIT = 30.0
EVERY = 0.4


@pytest.fixture
async def machines(tmp_path: Path, anyio_backend: str) -> AsyncIterator[tuple[Backend, Backend]]:
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(aiolease.open_backend(url))
        b = await stack.enter_async_context(aiolease.open_backend(url))
        yield a, b


async def test_the_job_runs_on_one_machine_per_interval(
    machines: tuple[Backend, Backend],
) -> None:
    a, b = machines
    runs: list[tuple[str, int]] = []

    async def job(lease: Lease, who: str) -> None:
        runs.append((who, lease.token))

    assert await run_at_most_once(a, "report", job, "a", every=EVERY)
    assert not await run_at_most_once(b, "report", job, "b", every=EVERY)
    assert not await run_at_most_once(a, "report", job, "a", every=EVERY)
    with anyio.fail_after(WAIT):  # the name is kept until the interval is up
        while (holder := await b.read("report")) is not None:
            await b.wait_changed("report", holder)
    assert await run_at_most_once(b, "report", job, "b", every=EVERY)
    assert [who for who, _ in runs] == ["a", "b"]
    assert runs[0][1] < runs[1][1]


async def test_run_every_on_two_machines_runs_the_job_once_per_interval(
    machines: tuple[Backend, Backend],
) -> None:
    starts: list[tuple[float, str]] = []
    enough = anyio.Event()

    async def job(lease: Lease, who: str) -> None:
        # When the grant came back (one process, one clock for both "machines"):
        # min_hold counts from there.
        assert lease._keep_until is not None
        starts.append((lease._keep_until - EVERY, who))
        if len(starts) == 4:
            enough.set()

    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            for backend, who in zip(machines, "ab", strict=True):
                tg.start_soon(partial(run_every, backend, "tick", job, who, every=EVERY))
            await enough.wait()
            tg.cancel_scope.cancel()
    gaps = [later - earlier for (earlier, _), (later, _) in zip(starts, starts[1:], strict=False)]
    # Never twice within an interval, counted from grant to grant (give or take the
    # rounding of the times' floats).
    assert all(gap >= EVERY - 1e-6 for gap in gaps), gaps


async def test_a_job_that_raises_timeout_is_not_taken_for_a_held_name() -> None:
    backend = DrivenMemoryBackend()

    async def job(lease: Lease) -> None:
        raise TimeoutError("the job's own")

    with pytest.raises(TimeoutError, match="the job's own"):
        await run_at_most_once(backend, "report", job, every=60)
    # It ran (and failed): the name is kept all the same.
    assert not await run_at_most_once(backend, "report", job, every=60)
    backend.advance(60)
    with pytest.raises(TimeoutError):
        await run_at_most_once(backend, "report", job, every=60)


async def test_run_every_goes_on_after_a_lost_run() -> None:
    backend = DrivenMemoryBackend()
    tokens: list[int] = []
    done = anyio.Event()

    async def job(lease: Lease) -> None:
        tokens.append(lease.token)
        if len(tokens) == 1:
            backend.lose("tick", LossReason.STOLEN)  # lost: cancelled, and nothing kept
            await anyio.sleep_forever()
        done.set()
        await anyio.sleep_forever()

    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(run_every, backend, "tick", job, every=3600))
            await done.wait()
            tg.cancel_scope.cancel()
    assert tokens == [1, 2]


async def test_every_is_checked() -> None:
    backend = DrivenMemoryBackend()

    async def job(lease: Lease) -> None:
        raise AssertionError("must not run")

    with pytest.raises(aiolease.InvalidArgument, match="every"):
        await run_at_most_once(backend, "report", job, every=0)
    with pytest.raises(aiolease.InvalidArgument, match="every"):
        await run_every(backend, "report", job, every=-1)


async def test_a_run_past_max_hold_is_cut_short() -> None:
    backend = DrivenMemoryBackend()

    async def job(lease: Lease) -> None:
        await anyio.sleep_forever()

    with pytest.raises(LeaseLostError) as info, anyio.fail_after(WAIT):
        await run_at_most_once(backend, "report", job, every=60, max_hold=0.05)
    assert info.value.reason is LossReason.MAX_HOLD
