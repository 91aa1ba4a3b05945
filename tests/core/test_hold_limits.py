"""``max_hold`` and ``min_hold`` (aiolease._limits), on the memory backend and the driven one."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta

import anyio
import pytest

from aiolease import (
    AsyncLock,
    Elector,
    InvalidArgument,
    Lease,
    LeaseHeldError,
    LeaseLostError,
    LossReason,
    UnsupportedCapability,
)
from aiolease.backends.memory import MemoryBackend
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.memory import DrivenMemoryBackend

pytestmark = pytest.mark.anyio

#: Bound on each test's waits (the machine is shared and slow).
WAIT = 30.0


# -- max_hold ----------------------------------------------------------------------------


async def test_a_block_held_past_max_hold_is_cancelled_and_released() -> None:
    backend = MemoryBackend()
    # Renewed every 0.05 s, stopped at 1 s: the loss is the limit, not an expiry. (The
    # ttl is long: only a stall of nearly a minute could let the deadline pass first, as
    # a stall of half a second did with a ttl of 1 s on a loaded machine.)
    lock = AsyncLock(backend, "job", ttl=60, renew_interval=0.05, max_hold=1.0)
    with pytest.raises(LeaseLostError) as info, anyio.fail_after(WAIT):
        async with lock as lease:
            await anyio.sleep_forever()
    assert info.value.reason is LossReason.MAX_HOLD
    assert lease.lost is LossReason.MAX_HOLD
    assert lease.renewals >= 1  # renewed until the limit
    assert await backend.read("job") is None  # released, not left to expire
    assert lock.statistics().losses == {LossReason.MAX_HOLD: 1}


async def test_a_body_that_ends_before_max_hold_is_not_touched() -> None:
    backend = MemoryBackend()
    lock = AsyncLock(backend, "job", ttl=10, max_hold=timedelta(minutes=5))
    async with lock as lease:
        await anyio.lowlevel.checkpoint()
    assert lease.lost is LossReason.RELEASED
    assert lock.statistics().losses == {}


async def test_renew_of_a_lease_past_max_hold_is_refused() -> None:
    backend = DrivenMemoryBackend()
    lease = await AsyncLock(backend, "job", ttl=3600, max_hold=60).acquire()
    await lease.renew()
    backend.advance(60)
    with pytest.raises(LeaseLostError) as info:
        await lease.renew()
    assert info.value.reason is LossReason.MAX_HOLD
    assert await lease.release() is False  # it was lost (to the limit): logged, then freed
    assert await backend.read("job") is None


async def test_a_leader_steps_down_at_max_hold_and_the_other_candidate_leads() -> None:
    backend = MemoryBackend()
    terms: list[str] = []
    defeats: list[LossReason] = []
    done = anyio.Event()

    async def lead(lease: Lease) -> None:
        terms.append(lease.identity)
        if len(terms) == 3:
            done.set()
        await anyio.sleep_forever()

    electors = [
        Elector(
            backend,
            "leader",
            ttl=0.6,
            identity=who,
            max_hold=0.2,
            retry_backoff=0.01,
            on_defeated=defeats.append,
        )
        for who in ("a", "b")
    ]
    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            for elector in electors:
                tg.start_soon(elector.run, lead)
            await done.wait()
            tg.cancel_scope.cancel()
    # Each stepped down at its limit, and the other candidate led next.
    assert terms[0] != terms[1] and terms[1] != terms[2], terms
    assert defeats[:2] == [LossReason.MAX_HOLD, LossReason.MAX_HOLD]


# -- min_hold ----------------------------------------------------------------------------


async def test_a_job_that_ended_early_keeps_its_name_until_min_hold() -> None:
    backend = DrivenMemoryBackend()
    lock = AsyncLock(backend, "report", ttl=5, min_hold=60)
    async with lock as lease:
        pass
    assert lease.lost is LossReason.RELEASED
    holder = await backend.read("report")
    # Left on the "server" for the rest of min_hold (more than the lock's ttl).
    assert holder is not None and holder.owner == lease.owner
    assert holder.remaining is not None and 5 < holder.remaining <= 60
    with pytest.raises(LeaseHeldError):
        await lock.acquire_nowait()
    backend.advance(59)
    with pytest.raises(LeaseHeldError):
        await lock.acquire_nowait()
    backend.advance(1)
    assert await backend.read("report") is None
    async with lock as again:
        assert again.token > lease.token


async def test_a_job_that_outlived_min_hold_is_released() -> None:
    backend = DrivenMemoryBackend()
    lock = AsyncLock(backend, "report", ttl=5, min_hold=10)
    async with lock:
        backend.advance(11)  # the block is renewed by the core: it lives through it
    assert await backend.read("report") is None


async def test_an_explicit_release_keeps_the_name_until_min_hold() -> None:
    backend = DrivenMemoryBackend()
    lease = await AsyncLock(backend, "report", ttl=5, min_hold=30).acquire()
    assert await lease.release() is True
    assert await lease.release() is False
    assert (await backend.read("report")) is not None
    backend.advance(30)
    assert await backend.read("report") is None


async def test_a_job_that_failed_keeps_its_name_too() -> None:
    backend = DrivenMemoryBackend()
    with pytest.raises(ZeroDivisionError):
        async with AsyncLock(backend, "report", ttl=5, min_hold=30):
            1 / 0  # noqa: B018
    assert (await backend.read("report")) is not None


async def test_a_lost_lease_is_not_kept() -> None:
    backend = DrivenMemoryBackend()
    lock = AsyncLock(backend, "report", ttl=5, min_hold=30)
    with pytest.raises(LeaseLostError), anyio.fail_after(WAIT):
        async with lock:
            backend.lose("report", LossReason.UNREACHABLE)
            await anyio.sleep_forever()
    assert await backend.read("report") is None  # released, not kept: it was not ours


async def test_a_run_cut_short_by_max_hold_keeps_the_name_until_min_hold() -> None:
    backend = DrivenMemoryBackend()
    lock = AsyncLock(backend, "report", ttl=5, max_hold=0.05, min_hold=30)
    with pytest.raises(LeaseLostError) as info, anyio.fail_after(WAIT):
        async with lock:
            await anyio.sleep_forever()
    assert info.value.reason is LossReason.MAX_HOLD
    assert (await backend.read("report")) is not None


async def test_a_failed_keep_is_logged_and_the_grant_expires_on_its_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inner = MemoryBackend()
    faulty = FaultyBackend(inner)
    async with AsyncLock(faulty, "report", ttl=5, min_hold=30) as lease:
        faulty.fail("renew")
    assert "keeping lease 'report' for min_hold failed" in caplog.text
    holder = await inner.read("report")
    assert holder is not None and holder.owner == lease.owner


# -- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, True, "10", 400 * 24 * 3600.0])
@pytest.mark.parametrize("option", ["max_hold", "min_hold"])
async def test_bad_limits_are_refused(option: str, bad: object) -> None:
    with pytest.raises(InvalidArgument, match=option):
        AsyncLock(MemoryBackend(), "job", ttl=1, **{option: bad})  # type: ignore[arg-type]


async def test_bad_max_hold_of_an_elector_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="max_hold"):
        Elector(MemoryBackend(), "leader", ttl=1, max_hold=timedelta(0))


async def test_min_hold_is_refused_on_a_session_backend(
    aiolease_server: Callable[[str], str],
) -> None:
    import aiolease

    async with aiolease.open_backend(aiolease_server("etcd")) as backend:
        with pytest.raises(UnsupportedCapability, match="min_hold"):
            AsyncLock(backend, "job", ttl=1, min_hold=10)
        AsyncLock(backend, "job", ttl=1, max_hold=10)  # max_hold works everywhere
