"""aiolease.testing.memory.DrivenMemoryBackend: a clock the test moves, and losses on demand."""

from __future__ import annotations

import anyio
import pytest

from aiolease import AsyncLock, Elector, InvalidArgument, Lease, LeaseLostError, LossReason
from aiolease.testing.memory import DrivenMemoryBackend

pytestmark = pytest.mark.anyio

WAIT = 30.0


async def test_advance_expires_a_lease_nobody_renews_here_and_on_the_server() -> None:
    backend = DrivenMemoryBackend()
    lease = await AsyncLock(backend, "job", ttl=60).acquire()
    backend.advance(30)
    # Its deadline came as much closer: ttl - margin - 30 s.
    lost = lease.lost
    assert lost is None and 20 < lease.remaining <= 60 - 6 - 30
    backend.advance(30)
    assert lease.lost is LossReason.EXPIRED
    assert await backend.read("job") is None
    assert backend.offset == 60
    again = await AsyncLock(backend, "job", ttl=60).acquire_nowait()
    assert again.token > lease.token


async def test_advance_keeps_a_lease_held_in_a_block() -> None:
    backend = DrivenMemoryBackend()
    async with AsyncLock(backend, "job", ttl=1) as lease:
        backend.advance(3600)
        await anyio.lowlevel.checkpoint()
        assert lease.lost is None
        holder = await backend.read("job")
        assert holder is not None and holder.owner == lease.owner
    assert await backend.read("job") is None


async def test_advance_wakes_a_waiter_when_the_holder_expires() -> None:
    backend = DrivenMemoryBackend()
    crashed = await AsyncLock(backend, "job", ttl=3600, identity="crashed").acquire()
    got: list[Lease] = []

    async def wait_for_it(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        lock = AsyncLock(backend, "job", ttl=3600, identity="next")
        task_status.started()
        got.append(await lock.acquire())

    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            await tg.start(wait_for_it)
            await anyio.wait_all_tasks_blocked()  # waiting for the name: woken by advance
            backend.advance(3600)
    assert crashed.lost is LossReason.EXPIRED
    [lease] = got
    assert lease.identity == "next" and lease.token > crashed.token


async def test_advance_brings_max_hold_closer() -> None:
    backend = DrivenMemoryBackend()
    with pytest.raises(LeaseLostError) as info, anyio.fail_after(WAIT):
        async with AsyncLock(backend, "job", ttl=10, max_hold=600):
            backend.advance(600)
            await anyio.sleep_forever()
    assert info.value.reason is LossReason.MAX_HOLD


@pytest.mark.parametrize("reason", [LossReason.STOLEN, LossReason.UNREACHABLE])
async def test_lose_cancels_the_block_with_that_reason(reason: LossReason) -> None:
    backend = DrivenMemoryBackend()
    cancelled = False
    with pytest.raises(LeaseLostError) as info, anyio.fail_after(WAIT):
        async with AsyncLock(backend, "job", ttl=10) as lease:
            backend.lose("job", reason)
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                cancelled = True
                raise
    assert cancelled
    assert info.value.reason is reason and lease.lost is reason
    assert await backend.read("job") is None


async def test_a_stolen_lease_frees_the_name_at_once() -> None:
    backend = DrivenMemoryBackend()
    lease = await AsyncLock(backend, "job", ttl=10).acquire()
    backend.lose("job")
    assert lease.lost is LossReason.STOLEN
    assert await backend.read("job") is None  # taken from it: free for the next
    with pytest.raises(LeaseLostError):
        await lease.renew()


async def test_an_elector_hears_of_the_loss_and_campaigns_again() -> None:
    backend = DrivenMemoryBackend()
    defeats: list[LossReason] = []
    tokens: list[int] = []
    elector = Elector(backend, "leader", ttl=10, retry_backoff=0.01, on_defeated=defeats.append)

    async def lead(lease: Lease) -> None:
        tokens.append(lease.token)
        if len(tokens) == 1:
            backend.lose("leader", LossReason.UNHEALTHY)
            await anyio.sleep_forever()

    with anyio.fail_after(WAIT):
        await elector.run(lead)
    assert defeats == [LossReason.UNHEALTHY]
    assert tokens == [1, 2]


async def test_lose_refuses_what_it_cannot_do() -> None:
    backend = DrivenMemoryBackend()
    with pytest.raises(LookupError, match="job"):
        backend.lose("job")
    await AsyncLock(backend, "job", ttl=10).acquire()
    with pytest.raises(InvalidArgument):
        backend.lose("job", LossReason.RELEASED)
    with pytest.raises(InvalidArgument):
        backend.advance(-1)
