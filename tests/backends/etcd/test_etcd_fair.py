"""The etcd backend's fair mode against real etcd, under asyncio and trio: queued keys
named by owner ids, arrival order, wake-one, and hand-offs within one backend.

Every test writes under a key prefix of its own (see :mod:`test_etcd`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack
from typing import Any

import anyio
import pytest

from aiolease import AsyncLock, Lease, LossReason
from aiolease.abc import Grant, HolderInfo
from aiolease.backends.etcd import EtcdBackend
from tests.backends.etcd.support import WAIT, Gateway, inner, open_etcd, opener, unique_prefix

pytestmark = pytest.mark.anyio


async def test_fair_mode_keys_are_owner_ids(anyio_backend: str, single_url: str) -> None:
    open_ = opener(single_url, fair=True)
    gateway = Gateway(single_url)
    prefix: str = open_.prefix  # type: ignore[attr-defined]
    async with open_() as backend:
        for owner in ("owner-1", "owner-2"):
            grant = await backend.try_acquire("n", owner, 30, "me", {})
            assert isinstance(grant, Grant)
            (kv,) = await gateway.keys(prefix)
            assert kv["key"] == f"{prefix}n/{owner}"
            assert json.loads(kv["value"]) == {"identity": "me", "metadata": {}}
            assert await backend.release("n", owner, grant.token) is True


async def test_a_retry_finds_its_own_key(anyio_backend: str, single_url: str) -> None:
    open_ = opener(single_url, fair=True)
    gateway = Gateway(single_url)
    async with open_() as backend:
        first = await backend.try_acquire("n", "holder", 30, "h", {})
        again = await backend.try_acquire("n", "holder", 30, "h", {})
        assert isinstance(first, Grant) and isinstance(again, Grant)
        assert again.token == first.token
        seen = await backend.read("n")
        assert seen is not None
        refused = await backend.try_acquire("n", "waiter", 30, "w", {})
        assert isinstance(refused, HolderInfo)
        for _ in range(2):  # a queued attempt retried after a lost reply keeps one key
            with anyio.move_on_after(0.2):
                await backend.wait_turn("n", "waiter", 30, seen)
        keys = sorted(kv["key"] for kv in await gateway.keys(open_.prefix))  # type: ignore[attr-defined]
        start = f"{open_.prefix}n/"  # type: ignore[attr-defined]
        assert keys == [start + "holder", start + "waiter"]
        assert await backend.release("n", "waiter", None) is False  # queued, never held
        assert await backend.release("n", "holder", first.token) is True


async def test_plain_mode_does_not_queue(anyio_backend: str, single_url: str) -> None:
    open_ = opener(single_url)
    gateway = Gateway(single_url)
    async with open_() as backend:
        await backend.try_acquire("n", "holder", 30, "h", {})
        seen = await backend.try_acquire("n", "waiter", 30, "w", {})
        assert isinstance(seen, HolderInfo)
        with anyio.move_on_after(0.2):
            await backend.wait_turn("n", "waiter", 30, seen)
        assert len(await gateway.keys(open_.prefix)) == 1  # type: ignore[attr-defined]


#: ``try_acquire`` calls per owner, counted by :class:`CountingEtcd`.
CALLS: dict[str, int] = {}


class CountingEtcd(EtcdBackend):
    """Counts ``try_acquire`` calls per owner in :data:`CALLS`."""

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Any
    ) -> Grant | HolderInfo:
        CALLS[owner] = CALLS.get(owner, 0) + 1
        return await super().try_acquire(name, owner, ttl, identity, metadata)


async def test_fair_mode_grants_in_arrival_order_and_wakes_one(
    anyio_backend: str, single_url: str
) -> None:
    prefix, waiters = unique_prefix(), 5
    gateway = Gateway(single_url)
    order: list[int] = []
    tokens: list[int] = []
    CALLS.clear()
    async with AsyncExitStack() as stack:
        backends = [
            await stack.enter_async_context(
                open_etcd(single_url, CountingEtcd, prefix=prefix, fair=True)
            )
            for _ in range(waiters + 1)
        ]
        holder = await AsyncLock(backends[0], "q", ttl=5).acquire()

        async def wait_in_line(i: int) -> None:
            async with AsyncLock(backends[i + 1], "q", ttl=5) as lease:
                order.append(i)
                tokens.append(lease.token)

        await line_up(gateway, prefix, holder, waiters, wait_in_line)
    assert order == list(range(waiters))
    assert tokens == sorted(tokens) and tokens[0] > holder.token
    # Each waiter tried once, then once more when its predecessor went: nobody else woke.
    assert sorted(CALLS.values()) == [1] + [2] * waiters


async def test_fair_mode_hands_off_between_tasks_of_one_backend_without_a_request(
    anyio_backend: str, single_url: str
) -> None:
    prefix, waiters = unique_prefix(), 4
    gateway = Gateway(single_url)
    order: list[int] = []
    tokens: list[int] = []
    CALLS.clear()
    async with open_etcd(single_url, CountingEtcd, prefix=prefix, fair=True) as backend:
        holder = await AsyncLock(backend, "q", ttl=5).acquire()

        async def wait_in_line(i: int) -> None:
            async with AsyncLock(backend, "q", ttl=5) as lease:
                order.append(i)
                tokens.append(lease.token)
                seen = await backend.read("q")  # the server agrees: its key is the first
                assert seen is not None and (seen.owner, seen.token) == (lease.owner, lease.token)

        await line_up(gateway, prefix, holder, waiters, wait_in_line)
        # Every release handed the name on; each waiter asked the server once (queued),
        # then took its turn without a request.
        assert inner(backend).statistics().local_handoffs == waiters
    assert order == list(range(waiters))
    assert tokens == sorted(tokens) and tokens[0] > holder.token
    assert sorted(CALLS.values()) == [1] + [2] * waiters


async def test_fair_mode_a_holder_deleted_by_somebody_else_hands_nothing_on(
    anyio_backend: str, single_url: str
) -> None:
    prefix = unique_prefix()
    gateway = Gateway(single_url)
    async with open_etcd(single_url, EtcdBackend, prefix=prefix, fair=True) as backend:
        lock = AsyncLock(backend, "q", ttl=5)
        holder = await lock.acquire()
        got = anyio.Event()

        async def wait() -> None:
            async with lock as lease:
                assert lease.token > holder.token
                got.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await gateway.wait_keys(prefix, 2)
            await gateway.delete(f"{prefix}q/{holder.owner}")  # not through the backend
            with anyio.fail_after(WAIT):  # woken by the watch of the holder's key
                await got.wait()
        assert holder.lost is None or holder.lost is LossReason.STOLEN
        await holder.release()
        assert inner(backend).statistics().local_handoffs == 0


async def line_up(
    gateway: Gateway,
    prefix: str,
    holder: Lease,
    waiters: int,
    wait_in_line: Callable[[int], Coroutine[Any, Any, None]],
) -> None:
    """Start ``waiters`` tasks, each queued before the next one comes, then release
    ``holder``: they take their turns, and leave no key behind."""
    async with anyio.create_task_group() as tg:
        for i in range(waiters):
            tg.start_soon(wait_in_line, i)
            await gateway.wait_keys(prefix, i + 2)
        await holder.release()
    assert await gateway.keys(prefix) == []
