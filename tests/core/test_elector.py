"""Elector: terms, re-campaigning, health step-down, resign, observe."""

from __future__ import annotations

import anyio
import pytest

from aiolease import Elector, LeaderInfo, Lease, LeaseLostError, LossReason
from aiolease.backends.memory import MemoryBackend
from aiolease.testing.faults import FaultyBackend

pytestmark = pytest.mark.anyio

TTL = 0.6


async def test_run_returns_the_value_and_resigns() -> None:
    backend = MemoryBackend()
    elector = Elector(backend, "leader", ttl=TTL, identity="a")

    async def work(lease: Lease, x: int) -> int:
        assert elector.is_leader and elector.lease is lease
        return x * 2

    assert await elector.run(work, 21) == 42
    assert not elector.is_leader
    assert await backend.read("leader") is None
    assert elector.statistics().terms == 1


async def test_run_recampaigns_after_loss_with_a_higher_token() -> None:
    inner = MemoryBackend()
    faulty = FaultyBackend(inner)
    events: list[object] = []
    elector = Elector(
        faulty,
        "leader",
        ttl=TTL,
        identity="a",
        retry_backoff=0.01,
        on_elected=lambda lease: events.append(("elected", lease.token)),
        on_defeated=events.append,
    )
    tokens: list[int] = []

    async def work(lease: Lease) -> str:
        tokens.append(lease.token)
        if len(tokens) == 1:
            faulty.hang("renew")
            await anyio.sleep_forever()
        faulty.heal()
        return "done"

    assert await elector.run(work) == "done"
    assert tokens == [1, 2]
    assert events == [("elected", 1), LossReason.UNREACHABLE, ("elected", 2)]
    stats = elector.statistics()
    assert stats.terms == 2 and stats.losses == {LossReason.UNREACHABLE: 1}


async def test_work_exception_propagates_and_resigns() -> None:
    backend = MemoryBackend()

    async def work(lease: Lease) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await Elector(backend, "leader", ttl=TTL).run(work)
    assert await backend.read("leader") is None


async def test_only_one_leader_at_a_time() -> None:
    backend = MemoryBackend()
    leading: list[str] = []
    overlaps: list[list[str]] = []
    terms = 0

    async def work(lease: Lease) -> None:
        nonlocal terms
        leading.append(lease.identity)
        if len(leading) > 1:
            overlaps.append(list(leading))
        await anyio.sleep(0.01)
        leading.remove(lease.identity)
        terms += 1

    async def candidate(name: str) -> None:
        elector = Elector(backend, "leader", ttl=TTL, identity=name, retry_backoff=0.001)
        for _ in range(3):
            await elector.run(work)

    async with anyio.create_task_group() as tg:
        for name in "abc":
            tg.start_soon(candidate, name)
    assert overlaps == [] and terms == 9


async def test_unhealthy_leader_steps_down_and_waits_until_healthy() -> None:
    inner = MemoryBackend()
    faulty = FaultyBackend(inner)
    healthy = True
    probes_after_stepdown = anyio.Event()
    probes = 0

    def probe() -> bool:
        nonlocal probes
        probes += 1
        if not healthy and probes > 6:
            probes_after_stepdown.set()
        return healthy

    terms: list[int] = []
    reasons: list[LossReason] = []

    async def work(lease: Lease) -> None:
        nonlocal healthy
        terms.append(lease.token)
        if len(terms) == 1:
            healthy = False
            await anyio.sleep_forever()

    elector = Elector(
        faulty,
        "leader",
        ttl=TTL,
        health=probe,
        health_interval=0.01,
        health_failures=2,
        retry_backoff=0.001,
        on_defeated=reasons.append,
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(elector.run, work)
        await probes_after_stepdown.wait()
        # Stepped down, released, and not campaigning while unhealthy.
        assert reasons == [LossReason.UNHEALTHY]
        assert await inner.read("leader") is None
        assert faulty.calls["try_acquire"] == 1
        healthy = True
    assert terms == [1, 2]


async def test_resign_ends_the_term_and_run_campaigns_again() -> None:
    backend = MemoryBackend()
    elector = Elector(backend, "leader", ttl=TTL, retry_backoff=0.001)
    terms: list[int] = []

    async def work(lease: Lease) -> str:
        terms.append(lease.token)
        if len(terms) == 1:
            assert await elector.resign() is True
            await anyio.sleep_forever()
        return "second"

    assert await elector.run(work) == "second"
    assert terms == [1, 2]
    assert await elector.resign() is False


async def test_leadership_is_one_term() -> None:
    inner = MemoryBackend()
    faulty = FaultyBackend(inner)
    elector = Elector(faulty, "leader", ttl=TTL)
    async with elector.leadership() as lease:
        assert elector.statistics().is_leader and elector.statistics().token == lease.token
    assert await inner.read("leader") is None and not elector.is_leader
    with pytest.raises(LeaseLostError) as info:
        async with elector.leadership():
            faulty.fail("renew")
            await anyio.sleep_forever()
    assert info.value.reason is LossReason.UNREACHABLE


async def test_observe_sees_every_change() -> None:
    backend = MemoryBackend()
    send, receive = anyio.create_memory_object_stream[LeaderInfo | None](10)
    observer = Elector(backend, "leader", ttl=TTL, identity="observer")

    async def observe() -> None:
        async for leader in observer.observe():
            await send.send(leader)

    seen: list[tuple[str, int] | None] = []

    async def next_seen() -> None:
        leader = await receive.receive()
        seen.append(None if leader is None else (leader.identity, leader.token))

    async with send, receive, anyio.create_task_group() as tg:
        tg.start_soon(observe)
        await next_seen()
        for name in ("a", "b", "c"):
            elector = Elector(backend, "leader", ttl=TTL, identity=name, metadata={"n": name})
            async with elector.leadership():
                await next_seen()
            await next_seen()
        tg.cancel_scope.cancel()
    assert seen == [None, ("a", 1), None, ("b", 2), None, ("c", 3), None]
    assert not observer.is_leader and observer.statistics().terms == 0
