"""The fair queue in each lease document: FIFO hand-offs across backend objects
(stand-ins for processes), only the next waiter woken, a dead waiter holding nobody up
for longer than its ttl, and cancelled waiters leaving no live entry."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread
import pytest

import aiolease
from aiolease import AsyncLock
from aiolease.abc import Backend, Grant, HolderInfo
from tests.backends.mongo.conftest import DATABASE
from tests.backends.mongo.support import inner, raw
from tests.support import eventually, unique

pytestmark = pytest.mark.anyio


async def waiting(b: Backend, count: int = 1) -> None:
    await eventually(lambda: inner(b).statistics().waiting >= count, "a blocked wait_turn")


def queue_of(url: str, collection: str, name: str) -> list[str]:
    """The owners queued in document ``name``, live or not, in order."""
    with raw(url) as client:
        doc: Any = client[DATABASE][collection].find_one({"_id": name})
    return [entry["owner"] for entry in (doc or {}).get("queue", [])]


async def test_waiters_of_different_backends_are_served_in_arrival_order(
    anyio_backend: str, mongo_url: str
) -> None:
    async with (
        aiolease.open_backend(mongo_url) as holder_side,
        aiolease.open_backend(mongo_url) as b1,
        aiolease.open_backend(mongo_url) as b2,
        aiolease.open_backend(mongo_url) as b3,
        aiolease.open_backend(mongo_url) as late,
    ):
        name = unique("fifo")
        first = await AsyncLock(holder_side, name, ttl=30).acquire()
        order: list[str] = []
        tokens: list[int] = [first.token]

        async def take(label: str, b: Backend) -> None:
            lease = await AsyncLock(b, name, ttl=30).acquire()
            order.append(label)
            tokens.append(lease.token)
            assert await lease.release()

        with anyio.fail_after(30):  # a hang guard
            async with anyio.create_task_group() as tg:
                for label, b in (("b1", b1), ("b2", b2), ("b3", b3), ("late", late)):
                    tg.start_soon(take, label, b)
                    await waiting(b)  # queued before the next one asks
                assert await first.release()
        assert order == ["b1", "b2", "b3", "late"]
        assert tokens == sorted(tokens) and len(set(tokens)) == 5
        # Handed over on the server, and taken from the change event without a command.
        assert sum(inner(b).statistics().handoffs_taken for b in (b1, b2, b3, late)) >= 1


async def test_a_release_wakes_only_the_next_waiter(anyio_backend: str, mongo_url: str) -> None:
    """The release hands the lease to the head of the queue on the server; the other
    waiters are not woken (they send no command) until their own turn."""
    async with (
        aiolease.open_backend(mongo_url) as holder_side,
        aiolease.open_backend(mongo_url) as head,
        aiolease.open_backend(mongo_url) as second,
    ):
        name = unique("next")
        first = await AsyncLock(holder_side, name, ttl=60).acquire()
        got: dict[str, Any] = {}
        handed = anyio.Event()

        async def take(label: str, b: Backend) -> None:
            lease = await AsyncLock(b, name, ttl=60).acquire()
            got[label] = lease
            handed.set()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(take, "head", head)
                await waiting(head)
                tg.start_soon(take, "second", second)
                await waiting(second)
                asked = inner(second).statistics().acquire_commands
                assert await first.release()
                await handed.wait()
                assert list(got) == ["head"]
                # The second waiter slept through the hand-off: no command of its own.
                assert inner(second).statistics().acquire_commands == asked
                assert await got["head"].release()
        assert got["second"].token == got["head"].token + 1
        assert await got["second"].release()


async def test_a_dead_waiter_holds_nobody_up_longer_than_its_ttl(
    anyio_backend: str, mongo_url: str
) -> None:
    """A waiter that queued with a 1 s ttl and died (never asks again, never releases):
    the lease handed to it lapses after its ttl, and the next waiter gets it."""
    async with (
        aiolease.open_backend(mongo_url) as holder_side,
        aiolease.open_backend(mongo_url) as dead,
        aiolease.open_backend(mongo_url) as live,
    ):
        name = unique("dead")
        first = await AsyncLock(holder_side, name, ttl=30).acquire()
        refused = await dead.try_acquire(name, "dead-owner", 1.0, "dead", {})
        assert isinstance(refused, HolderInfo)
        # The live waiter's own refresh and the holder's ttl are far off: the guard
        # fails unless the end of the dead waiter's grant wakes the live one.
        with anyio.fail_after(20):  # a hang guard: the dead waiter's ttl is 1 s
            async with anyio.create_task_group() as tg:

                async def take() -> None:
                    lease = await AsyncLock(live, name, ttl=600).acquire()
                    holder = await live.read(name)
                    assert holder is not None and holder.owner == lease.owner
                    assert lease.token == first.token + 2  # after the dead one's grant
                    assert await lease.release()

                tg.start_soon(take)
                await waiting(live)
                assert await first.release()  # handed to the dead waiter, if still live


async def test_cancelled_waiters_leave_no_live_entry(
    anyio_backend: str, mongo: str, mongo_url: str, collection: str
) -> None:
    async with (
        aiolease.open_backend(mongo_url) as holder_side,
        aiolease.open_backend(mongo_url) as waiters,
    ):
        name = unique("cancelled")
        first = await AsyncLock(holder_side, name, ttl=30).acquire()
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(5):
                    tg.start_soon(AsyncLock(waiters, name, ttl=30).acquire)
                await waiting(waiters, 5)
                assert len(await anyio.to_thread.run_sync(queue_of, mongo, collection, name)) == 5
                tg.cancel_scope.cancel()
        assert await anyio.to_thread.run_sync(queue_of, mongo, collection, name) == []
        assert await first.release()
        grant = await holder_side.try_acquire(name, "after", 30, "after", {})
        assert isinstance(grant, Grant) and grant.token == first.token + 1


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the backend's own loop clock
async def test_a_late_event_of_a_lapsed_hand_off_is_not_taken(
    anyio_backend: str, mongo_url: str
) -> None:
    """A waiter takes a hand-off from a change event only when its token is newer than
    the one its latest refusal saw: an event that arrives after a later refusal (the
    grant it announces lapsed meanwhile) makes it ask the server instead."""
    async with aiolease.open_backend(mongo_url) as b:
        backend, name = inner(b), unique("late")
        holder = await b.try_acquire(name, "holder", 30, "h", {})
        assert isinstance(holder, Grant)
        refused = await b.try_acquire(name, "waiter", 30, "w", {})
        assert isinstance(refused, HolderInfo) and refused.token == holder.token
        turns = backend._turns
        turns.start(name, "waiter")
        turns.granted(name, "waiter", holder.token, None)  # not newer than the refusal's
        assert backend._handed(name, "waiter", 30.0) is None
        turns.start(name, "waiter")
        turns.granted(name, "waiter", holder.token + 1, None)  # a hand-off after it
        taken = backend._handed(name, "waiter", 30.0)
        assert taken is not None and taken.token == holder.token + 1
        assert taken.sent_at is not None and taken.sent_at <= anyio.current_time()
        assert await b.release(name, "holder", holder.token)
