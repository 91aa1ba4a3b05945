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


async def test_a_release_grants_a_waiter_of_its_backend_as_it_is_written(
    anyio_backend: str, zk_url: str
) -> None:
    """A release through the backend object a request waits at grants it in the
    release's own write (one Multi: the delete, and the SetData that marks the waiter
    held): the waiter's retry sends nothing. Every node before the waiter being this
    backend's, its token is its create's zxid, which the node's data records for
    read_permits; a later grant's token is larger."""
    prefix = unique_prefix()
    async with (
        aiolease.open_backend(zk_url, prefix=prefix) as backend,
        Outside(zk_url) as outside,
    ):
        zk = inner(backend)
        holder, waiter, later = permit_owner(), permit_owner(), permit_owner()
        held = await backend.try_acquire_permit("n", holder, LONG, "h", {}, 1, 1)
        refused = await backend.try_acquire_permit("n", waiter, LONG, "w", {}, 1, 1)
        assert isinstance(held, Grant) and isinstance(refused, HolderInfo)
        woken = anyio.Event()

        async def wait() -> None:
            await backend.wait_permit_turn("n", waiter, LONG, refused)
            woken.set()

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait)
                await anyio.wait_all_tasks_blocked()
                await backend.read_permits("n")  # (the waiter waits by now, on any loop)
                assert not woken.is_set()
                before = zk.statistics().requests
                assert await backend.release("n", holder, held.token)
                await woken.wait()
            granted = await backend.try_acquire_permit("n", waiter, LONG, "w", {}, 1, 1)
        assert isinstance(granted, Grant)
        assert zk.statistics().requests == before + 1  # the release's Multi alone
        assert zk.statistics().permit_hand_offs == 1
        parent = f"{outside.chroot}/{prefix}/n%permits"
        (node,) = await outside.children(parent)
        data, stat = await outside.call("get", f"{parent}/{node}")
        assert stat.czxid == granted.token > held.token
        assert json.loads(data)["h"] is True and json.loads(data)["t"] == granted.token
        permits = await backend.read_permits("n")
        assert permits is not None and [h.token for h in permits.holders] == [granted.token]
        assert permits.holders[0].owner == waiter
        queued = await backend.try_acquire_permit("n", later, LONG, "l", {}, 1, 1)
        assert isinstance(queued, HolderInfo) and queued.token == granted.token
        assert await backend.release("n", waiter, granted.token)
        again = await backend.try_acquire_permit("n", later, LONG, "l", {}, 1, 1)
        assert isinstance(again, Grant) and again.token > granted.token


async def test_grants_through_two_backends_follow_their_requests(
    anyio_backend: str, zk_url: str
) -> None:
    """Tasks on two backend objects (two sessions) loop on a semaphore of 3, granted
    by releases of their own backend as much as by their own requests: never more
    than 3 inside, every token new, and each grant's token larger than that of every
    grant whose block ended before its request was made."""
    inside, peak = 0, 0
    ended: list[int] = []  # tokens of the blocks that ended, in that order
    open_ = opener(zk_url)
    async with open_() as first, open_() as second:

        async def body(backend: aiolease.abc.Backend, turns: int) -> None:
            nonlocal inside, peak
            semaphore = AsyncSemaphore(backend, "n", limit=3, ttl=LONG)
            for _ in range(turns):
                before = max(ended, default=0)
                async with semaphore as permit:
                    assert permit.token > before
                    inside += 1
                    peak = max(peak, inside)
                    for _ in range(random.randrange(3)):
                        await anyio.lowlevel.checkpoint()
                    inside -= 1
                    ended.append(permit.token)

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                for index in range(12):
                    tg.start_soon(body, first if index % 4 else second, 8)
        assert peak <= 3
        assert len(set(ended)) == len(ended) == 96


async def test_a_request_among_its_backends_own_nodes_is_created_without_a_listing(
    anyio_backend: str, zk_url: str
) -> None:
    """Once a listing has shown a name's nodes, a request of the same backend object is
    one create, not a create and a listing, while the name's nodes are its own: the
    create's sequence number shows that nobody else created one meanwhile. A node
    another session creates is never missed: the next request lists the nodes again,
    and counts it (a limit of 2, full: refused)."""
    prefix = unique_prefix()
    open_ = opener(zk_url, prefix=prefix)
    async with open_() as backend, open_() as other:
        zk = inner(backend)
        first, second, third, foreign = (permit_owner() for _ in range(4))
        held = await backend.try_acquire_permit("n", first, LONG, "a", {}, 2, 1)
        assert isinstance(held, Grant)
        before = zk.statistics().requests
        also = await backend.try_acquire_permit("n", second, LONG, "a", {}, 2, 1)
        assert isinstance(also, Grant) and also.token > held.token
        assert zk.statistics().requests == before + 1  # the create alone
        assert await backend.release("n", second, also.token)
        theirs = await other.try_acquire_permit("n", foreign, LONG, "b", {}, 2, 1)
        assert isinstance(theirs, Grant)
        before = zk.statistics().requests
        refused = await backend.try_acquire_permit("n", third, LONG, "a", {}, 2, 1)
        assert isinstance(refused, HolderInfo) and refused.owner == first
        # The create; then a listing (its sequence number showed another create), and
        # the SetData that marks its node queued.
        assert zk.statistics().requests == before + 3
        assert await other.release("n", foreign, theirs.token)
        with anyio.fail_after(WAIT):
            while not isinstance(
                granted := await backend.try_acquire_permit("n", third, LONG, "a", {}, 2, 1),
                Grant,
            ):
                await backend.wait_permit_turn("n", third, LONG, granted)
        assert granted.token > theirs.token
        permits = await backend.read_permits("n")
        assert permits is not None and {h.owner for h in permits.holders} == {first, third}
