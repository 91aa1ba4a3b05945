"""Permits (semaphores, read-write locks) on real ZooKeeper: what the conformance suite
cannot see from outside one backend object. Two backend objects stand for two
processes (two sessions); the server is inspected through kazoo."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import anyio
import pytest

import aiolease
from aiolease import AsyncReadWriteLock, AsyncSemaphore, LeaseLostError, LossReason
from aiolease.abc import Grant, HolderInfo, permit_owner
from tests.backends.safety import race_for_permits
from tests.backends.zookeeper.support import Outside, inner, opener, unique_prefix
from tests.backends.zookeeper.test_zookeeper_sessions import expire_session

pytestmark = pytest.mark.anyio

#: Bound on each test's waits (the machine is shared and slow): a hang guard.
WAIT = 60.0
LONG = 30.0


@pytest.fixture
def zk_url(aiolease_server: Callable[[str], str]) -> str:
    return aiolease_server("zookeeper")


async def test_two_backends_never_hold_more_than_the_limit(anyio_backend: str, zk_url: str) -> None:
    """Tasks on two sessions share a limit of 2: never more inside at once, a waiter
    on one is woken (by a watch) by a release on the other, every grant a new token."""
    inside, peak, tokens = 0, 0, []
    full = anyio.Event()
    open_ = opener(zk_url)
    async with open_() as first, open_() as second:

        async def body(backend: aiolease.abc.Backend) -> None:
            nonlocal inside, peak
            async with AsyncSemaphore(backend, "n", limit=2, ttl=LONG) as permit:
                tokens.append(permit.token)
                inside += 1
                peak = max(peak, inside)
                if inside == 2:
                    full.set()
                await full.wait()
                await anyio.lowlevel.checkpoint()
                inside -= 1

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                for backend in (first, second, first, second, first, second):
                    tg.start_soon(body, backend)
        assert peak == 2
        assert len(set(tokens)) == 6
        assert await second.read_permits("n") is None


async def test_a_permit_is_a_node_whose_name_says_its_request(
    anyio_backend: str, zk_url: str
) -> None:
    """Nodes under ``<name>%permits`` carry owner, limit and weight in their names; a
    granted node's token is its czxid, a queued one marked so, and when its turn comes
    the write that marks it held gives it a new, larger token. A lock of the same
    name lives apart."""
    prefix = unique_prefix()
    async with (
        aiolease.open_backend(zk_url, prefix=prefix) as backend,
        Outside(zk_url) as outside,
    ):
        owners = [permit_owner() for _ in range(3)]
        tokens = []
        for owner in owners[:2]:
            grant = await backend.try_acquire_permit("a/b", owner, LONG, "host", {}, 2, 1)
            assert isinstance(grant, Grant)
            tokens.append(grant.token)
        refused = await backend.try_acquire_permit("a/b", owners[2], LONG, "host", {}, 2, 1)
        assert isinstance(refused, HolderInfo) and refused.owner == owners[0]
        assert refused.token == tokens[0]
        parent = f"/{prefix}/a%2Fb%permits"
        nodes = sorted(await outside.children(parent), key=lambda n: n.rsplit("-", 1)[1])
        assert [n.split("-p")[0] for n in nodes] == ["_c_" + o.replace(":", "%3A") for o in owners]
        assert all(n.rsplit("-", 2)[1] == "p2x1" for n in nodes)
        stats = [await outside.call("get", f"{outside.chroot}{parent}/{n}") for n in nodes]
        assert [json.loads(data)["h"] for data, _ in stats] == [True, True, False]
        assert [stat.czxid for _, stat in stats[:2]] == tokens
        assert await backend.release("a/b", owners[0], tokens[0])
        grant = await backend.try_acquire_permit("a/b", owners[2], LONG, "host", {}, 2, 1)
        assert isinstance(grant, Grant) and grant.token > stats[2][1].czxid > tokens[1]
        data, stat = await outside.call("get", f"{outside.chroot}{parent}/{nodes[2]}")
        assert json.loads(data)["h"] is True and stat.mzxid == grant.token
        assert isinstance(await backend.try_acquire("a/b", "lock-owner", LONG, "h", {}), Grant)


async def test_a_lost_session_ends_its_permits(anyio_backend: str, zk_url: str) -> None:
    """The server expires the backend's session: every permit on it is lost
    (``STOLEN``), its node gone with the session; the next grant has a larger token."""
    async with aiolease.open_backend(zk_url, prefix=unique_prefix(), session_timeout=4) as backend:
        zk = inner(backend)
        rw = AsyncReadWriteLock(backend, "n", ttl=4)
        with anyio.fail_after(WAIT), pytest.raises(LeaseLostError) as info:
            async with rw.read() as permit:
                session = zk.statistics().session_id
                await expire_session(zk_url, session, zk._wire.client.session.password)
                await anyio.sleep_forever()
        assert info.value.reason is LossReason.STOLEN
        assert await backend.read_permits("n") is None
        async with rw.write() as again:
            assert again.token > permit.token


async def test_a_queued_request_leaves_the_queue_on_release_whatever_the_token(
    anyio_backend: str, zk_url: str
) -> None:
    """As on the memory model: ``release`` of a queued request drops its node, even
    with a token it was never granted, and frees nothing; the next reader gets in."""
    async with opener(zk_url)() as backend:
        reader, writer = permit_owner(), permit_owner()
        read = await backend.try_acquire_permit("n", reader, LONG, "h", {}, 2**31 - 1, 1)
        assert isinstance(read, Grant)
        queued = await backend.try_acquire_permit("n", writer, LONG, "h", {}, 2**31 - 1, 2**31 - 1)
        assert isinstance(queued, HolderInfo)
        assert await backend.release("n", reader, None)
        assert not await backend.release("n", writer, 1)  # never its token
        assert await backend.read_permits("n") is None
        again = await backend.try_acquire_permit("n", reader, LONG, "h", {}, 2**31 - 1, 1)
        assert isinstance(again, Grant) and again.token > read.token


async def test_cancelled_permit_acquires_leave_no_node(anyio_backend: str, zk_url: str) -> None:
    """200 impatient tasks on a semaphore of 2 (on two sessions), cancelled at random
    points of their acquire: never more than 2 inside, and once all are done, no
    permit node is left (a node whose create reply was lost is found by its owner id
    and deleted)."""
    prefix = unique_prefix()
    inside = peak = 0
    async with (
        aiolease.open_backend(zk_url, prefix=prefix) as one,
        aiolease.open_backend(zk_url, prefix=prefix) as two,
        Outside(zk_url) as outside,
    ):

        async def contender(backend: aiolease.abc.Backend, patience: float) -> None:
            nonlocal inside, peak
            with anyio.move_on_after(patience):
                async with AsyncSemaphore(backend, "storm", limit=2, ttl=LONG):
                    inside += 1
                    peak = max(peak, inside)
                    await anyio.sleep(0.005)
                    inside -= 1

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                for i in range(200):
                    tg.start_soon(contender, (one, two)[i % 2], random.uniform(0, 0.05))
        assert peak <= 2
        assert await outside.children(f"/{prefix}/storm%permits") == []


async def test_a_foreign_node_among_permits_is_reported_and_left(
    anyio_backend: str, zk_url: str
) -> None:
    prefix = unique_prefix()
    async with (
        aiolease.open_backend(zk_url, prefix=prefix) as backend,
        Outside(zk_url) as outside,
    ):
        parent = f"{outside.chroot}/{prefix}/n%permits"
        await outside.call("create", f"{parent}/not-ours", b"x", makepath=True)
        with pytest.raises(aiolease.ForeignDataError, match="not-ours"):
            await backend.try_acquire_permit("n", permit_owner(), LONG, "h", {}, 2, 1)
        with pytest.raises(aiolease.ForeignDataError):
            await backend.read_permits("n")
        assert await outside.children(f"/{prefix}/n%permits") == ["not-ours"]


async def test_the_first_waiter_wakes_when_a_permit_goes_not_when_one_arrives(
    anyio_backend: str, zk_url: str
) -> None:
    """The first waiter in line watches the nodes before its own: a request arriving
    behind it (on the same session, whose watch events come before later replies)
    does not wake it; the holder's release does."""
    async with opener(zk_url)() as backend:
        holder, first, late = permit_owner(), permit_owner(), permit_owner()
        held = await backend.try_acquire_permit("n", holder, LONG, "h", {}, 1, 1)
        assert isinstance(held, Grant)
        seen = await backend.try_acquire_permit("n", first, LONG, "h", {}, 1, 1)
        assert isinstance(seen, HolderInfo)
        woken = anyio.Event()

        async def wait() -> None:
            await backend.wait_permit_turn("n", first, LONG, seen)
            woken.set()

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait)
                # Its watches are set once a request sent after them is answered.
                await backend.read_permits("n")
                await backend.read_permits("n")
                assert isinstance(
                    await backend.try_acquire_permit("n", late, LONG, "h", {}, 1, 1), HolderInfo
                )
                permits = await backend.read_permits("n")
                assert permits is not None and permits.waiting == 2
                assert not woken.is_set()
                assert await backend.release("n", holder, held.token)
                await woken.wait()
        granted = await backend.try_acquire_permit("n", first, LONG, "h", {}, 1, 1)
        assert isinstance(granted, Grant) and granted.token > held.token


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the backend's races, not the loop's
async def test_a_storm_of_requests_is_served_without_giving_up(
    anyio_backend: str, zk_url: str
) -> None:
    """32 tasks take one of 2 permits 8 times each, with no hold (etcd's storm, which
    made its requests give up with BackendUnavailable): every request is served."""
    async with opener(zk_url)() as backend:
        await race_for_permits(AsyncSemaphore(backend, "storm", limit=2, ttl=LONG), wait=WAIT)


async def test_a_waiter_is_woken_by_a_listing_that_shows_its_turn(
    anyio_backend: str, zk_url: str
) -> None:
    """A waiter of the same backend whose turn a listing shows (here read_permits') is
    woken then, not only once the waiter before it is granted (which the second
    waiter watched alone: waiters then learnt of their turns one after the other, and
    a semaphore served no faster than a lock). Its retry takes the permit."""
    ttl = 600.0  # a wait's own bound (half of it) is far beyond the test's
    async with opener(zk_url)() as backend:
        holders = [permit_owner(), permit_owner()]
        first, second = permit_owner(), permit_owner()
        grants = [await backend.try_acquire_permit("n", h, ttl, "h", {}, 2, 1) for h in holders]
        assert all(isinstance(g, Grant) for g in grants)
        seen: dict[str, HolderInfo] = {}
        for waiter in (first, second):
            refused = await backend.try_acquire_permit("n", waiter, ttl, "h", {}, 2, 1)
            assert isinstance(refused, HolderInfo)
            seen[waiter] = refused
        woken = anyio.Event()

        async def wait() -> None:
            await backend.wait_permit_turn("n", second, ttl, seen[second])
            woken.set()

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait)
                # Its watch is set once a request sent after it is answered.
                await backend.read_permits("n")
                await backend.read_permits("n")
                assert not woken.is_set()
                for holder, grant in zip(holders, grants, strict=True):
                    assert isinstance(grant, Grant)
                    assert await backend.release("n", holder, grant.token)
                # Both free: the first waiter is not retried; a listing shows the turn.
                await backend.read_permits("n")
                await woken.wait()
        granted = await backend.try_acquire_permit("n", second, ttl, "h", {}, 2, 1)
        assert isinstance(granted, Grant)
        also = await backend.try_acquire_permit("n", first, ttl, "h", {}, 2, 1)
        assert isinstance(also, Grant) and also.token > granted.token
        permits = await backend.read_permits("n")
        assert permits is not None and len(permits.holders) == 2 and permits.waiting == 0
