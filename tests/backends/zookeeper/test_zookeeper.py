"""The ZooKeeper backend against the real server of ``scripts/services.sh``, under
asyncio and trio. Every test works under a prefix node of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

import aiolease
from aiolease import AsyncLock, Capability, InvalidArgument, LeaseHeldError
from aiolease._bridge import call_asyncio, running_trio
from aiolease.abc import Grant, HolderInfo
from aiolease.backends._asyncio import timeout_after
from aiolease.backends.zookeeper import ZooKeeperBackend
from aiolease.backends.zookeeper._nodes import Layout
from aiolease.backends.zookeeper._url import parse_url
from aiolease.testing import CHECKS, Check
from aiolease.testing.model import make_model_machine
from tests.backends.zookeeper.support import Outside, inner, opener, unique_prefix
from tests.support import eventually, on_asyncio, unique

pytestmark = pytest.mark.anyio


@pytest.fixture
def zk_url(aiolease_server: Callable[[str], str]) -> str:
    return aiolease_server("zookeeper")


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
async def test_conformance(anyio_backend: str, zk_url: str, check: Check) -> None:
    await check(opener(zk_url))


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_agrees_with_the_model(zk_url: str, loop: str) -> None:
    # Tokens are zxids: increasing, not consecutive. A permit node's weight is in its
    # name: a queued request retried with another weight is a new one (at the back).
    machine = make_model_machine(
        opener(zk_url), anyio_backend=loop, exact_tokens=False, fixed_weights=True
    )
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=15,
            stateful_step_count=30,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# -- URLs and options --------------------------------------------------------------------


def test_urls_name_every_server_and_the_chroot() -> None:
    parsed = parse_url("zookeeper://10.0.0.1,h2:2182,[::1]:2183/app/locks?prefix=p", {})
    assert parsed.endpoints == (("10.0.0.1", 2181), ("h2", 2182), ("::1", 2183))
    assert parsed.chroot == "/app/locks"
    assert parsed.connect_string() == "10.0.0.1:2181,h2:2182,[::1]:2183"
    assert dict(parsed.options) == {"prefix": "p"}
    assert parse_url("zk://h", {"session_timeout": 3}).chroot == ""


@pytest.mark.parametrize(
    ("url", "options", "match"),
    [
        ("redis://127.0.0.1", {}, "zookeeper://"),
        ("zookeeper://", {}, "no server"),
        ("zookeeper://h:port", {}, "bad port"),
        ("zookeeper://h:70000", {}, "out of range"),
        ("zookeeper://h/a/../b", {}, "not a valid node path"),
        ("zookeeper://h/a//b", {}, "not a valid node path"),
        ("zookeeper://u:p@h", {}, "does not log in"),
        ("zookeeper://h?nosuch=1", {}, "unknown ZooKeeper option"),
        ("zookeeper://h", {"nosuch": 1}, "unknown ZooKeeper option"),
        ("zookeeper://h?prefix=a", {"prefix": "b"}, "given in the URL and as arguments"),
    ],
)
def test_bad_urls_are_invalid(url: str, options: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        parse_url(url, options)


@pytest.mark.parametrize(
    ("query", "match"),
    [
        ("session_timeout=soon", "not a number"),
        ("timeout=0", "timeout"),
        ("session_timeout=-1", "session_timeout"),
        ("prefix=", "must name a node"),
        ("prefix=a/../b", "not a valid node path"),
    ],
)
async def test_bad_options_are_invalid(anyio_backend: str, query: str, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        async with aiolease.open_backend(f"zookeeper://127.0.0.1:2181?{query}"):
            pass  # pragma: no cover


async def test_an_unreachable_server_is_unavailable(anyio_backend: str) -> None:
    with pytest.raises(aiolease.BackendUnavailable, match="127.0.0.1:1"):
        async with aiolease.open_backend("zookeeper://127.0.0.1:1?timeout=1"):
            pass  # pragma: no cover


async def test_capabilities(anyio_backend: str, zk_url: str) -> None:
    async with opener(zk_url)() as backend:
        assert backend.capabilities == {
            Capability.PUSH_WAKEUP,
            Capability.FAIR_QUEUE,
            Capability.SERVER_TIME,
            Capability.DURABLE_TOKENS,
            Capability.SESSION,
            Capability.MULTI_PROCESS,
            Capability.PROCLAIM,
            Capability.SEMAPHORE,
            Capability.FAIR_PERMITS,
            # not PERMIT_RETRY_KEEPS_ENTRY: a retry with another weight is a new request
        }
        assert "127.0.0.1:2181" in repr(inner(backend))


# -- the nodes -----------------------------------------------------------------------------


async def test_a_grant_is_an_ephemeral_sequential_node_of_the_session(
    anyio_backend: str, zk_url: str
) -> None:
    """Its name carries the owner (protected mode), its czxid is the token, and its
    ephemeralOwner is the backend's one session; releasing deletes it."""
    prefix = unique_prefix()
    async with opener(zk_url, prefix=prefix)() as backend, Outside(zk_url) as outside:
        lease = await AsyncLock(backend, "a/b", ttl=5).acquire_nowait()
        name_node = Layout(f"/{prefix}").name_node("a/b")
        assert name_node == f"/{prefix}/a%2Fb"
        (node,) = await outside.children(name_node)
        assert node.startswith(f"_c_{lease.owner}-lock-") and node[-10:].isdigit()
        _, stat = await outside.call("get", f"{name_node}/{node}")
        assert stat.czxid == lease.token
        assert stat.ephemeralOwner == inner(backend).statistics().session_id
        assert await lease.release()
        assert await outside.children(name_node) == []


async def test_a_chroot_holds_every_node(anyio_backend: str, zk_url: str) -> None:
    chroot = f"/{unique_prefix()}"
    async with (
        aiolease.open_backend(f"{zk_url}{chroot}", prefix="locks") as backend,
        Outside(zk_url) as outside,
    ):
        async with AsyncLock(backend, "n", ttl=5):
            assert await outside.children(f"{chroot}/locks/n") != []


async def test_a_refused_try_leaves_no_node(anyio_backend: str, zk_url: str) -> None:
    """kazoo#732: a non-blocking acquire that is refused leaves no contender behind."""
    prefix = unique_prefix()
    async with opener(zk_url, prefix=prefix)() as backend, Outside(zk_url) as outside:
        async with AsyncLock(backend, "n", ttl=5):
            for _ in range(3):
                with pytest.raises(LeaseHeldError):
                    await AsyncLock(backend, "n", ttl=5).acquire_nowait()
            assert len(await outside.children(f"/{prefix}/n")) == 1


async def test_a_users_client_is_used_and_never_closed(anyio_backend: str, zk_url: str) -> None:
    prefix = unique_prefix()
    connect = parse_url(zk_url, {}).connect_string()
    async with AsyncExitStack() as stack:
        if running_trio():
            import trio_asyncio

            await stack.enter_async_context(trio_asyncio.open_loop())

        async def scenario() -> tuple[int, bool, list[str]]:
            import aiozk

            client = aiozk.ZKClient(connect)
            await client.start()
            try:
                async with ZooKeeperBackend(client, prefix=prefix) as backend:
                    grant = await backend.try_acquire("n", "o", 5, "me", {})
                    assert isinstance(grant, Grant)
                left = await client.get_children(f"/{prefix}/n")
                return grant.token, await client.exists("/"), left
            finally:
                await client.close()

        if running_trio():
            token, alive, left = await call_asyncio(scenario)
        else:
            token, alive, left = await scenario()
    assert token > 0 and alive
    assert left == []  # closing the backend deleted its node, not the session


# -- one session, many leases ----------------------------------------------------------------


async def test_many_leases_cost_only_the_sessions_pings(anyio_backend: str, zk_url: str) -> None:
    """100 held leases: while they are held, the backend sends its pings and nothing
    else (no request per lease per tick)."""
    async with aiolease.open_backend(zk_url, prefix=unique_prefix(), session_timeout=1) as b:
        zk = inner(b)
        async with AsyncExitStack() as held:
            for i in range(100):
                await held.enter_async_context(AsyncLock(b, f"n{i}", ttl=1))
            before = zk.statistics()
            # Three ticks of the session (a third of its timeout each).
            await eventually(lambda: zk.statistics().pings >= before.pings + 3, "3 pings")
            after = zk.statistics()
            assert after.entries == 100
        assert after.requests - before.requests == after.pings - before.pings


async def test_a_ttl_longer_than_the_session_is_cut_to_it(anyio_backend: str, zk_url: str) -> None:
    async with aiolease.open_backend(zk_url, prefix=unique_prefix(), session_timeout=2) as b:
        negotiated = inner(b).statistics().negotiated_timeout
        assert negotiated == 2.0
        grant = await b.try_acquire("n", "o", 30.0, "me", {})
        assert isinstance(grant, Grant) and grant.ttl == negotiated
        short = await b.try_acquire("m", "o", 0.5, "me", {})
        assert isinstance(short, Grant) and short.ttl == 0.5


# -- order -------------------------------------------------------------------------------------


async def test_waiters_are_granted_in_arrival_order(anyio_backend: str, zk_url: str) -> None:
    prefix = unique_prefix()
    order: list[int] = []
    async with opener(zk_url, prefix=prefix)() as backend, Outside(zk_url) as outside:
        lock = AsyncLock(backend, "fifo", ttl=5)

        def queued(count: int) -> Callable[[], Awaitable[bool]]:
            async def there() -> bool:
                return len(await outside.children(f"/{prefix}/fifo")) >= count

            return there

        async def waiter(index: int) -> None:
            async with lock:
                order.append(index)

        async with anyio.create_task_group() as tg:
            held = await lock.acquire_nowait()
            for index in range(5):
                tg.start_soon(waiter, index)
                # Queued (its node is there) before the next one comes.
                await eventually(queued(index + 2), f"waiter {index} queued")
            await held.release()
    assert order == list(range(5))


async def test_a_release_here_hands_the_name_to_the_next_without_a_listing(
    anyio_backend: str, zk_url: str
) -> None:
    """The waiter just behind a node released through the same backend is first once
    that node is gone: it is granted without listing the queue (one request fewer per
    hand-off), still in arrival order. A waiter behind one that gave up lists again."""
    prefix = unique_prefix()
    order: list[int] = []
    async with opener(zk_url, prefix=prefix)() as backend, Outside(zk_url) as outside:
        zk = inner(backend)
        lock = AsyncLock(backend, "next", ttl=5)

        async def waiter(index: int) -> None:
            async with lock:
                order.append(index)

        async with anyio.create_task_group() as tg:
            held = await lock.acquire_nowait()
            for index in range(3):
                tg.start_soon(waiter, index)
                await eventually(_count(outside, f"/{prefix}/next", index + 2), "waiter queued")
            gives_up = anyio.CancelScope()  # queued behind waiter 2, then gone
            tg.start_soon(_cancelled_waiter, lock, gives_up)
            await eventually(lambda: _children(outside, f"/{prefix}/next", 5), "queued")
            gives_up.cancel()
            await eventually(lambda: _children(outside, f"/{prefix}/next", 4, exact=True), "gone")
            tg.start_soon(waiter, 3)
            await eventually(lambda: _children(outside, f"/{prefix}/next", 5), "waiter 3 queued")
            await held.release()
        assert order == [0, 1, 2, 3]
        # Each waiter came after a node released here. Waiter 3 came after the one
        # that gave up: that node's delete made it list the queue, and wait on
        # waiter 2's node, not take the name.
        assert zk.statistics().hand_offs == 4


async def test_a_holder_here_is_known_without_a_request(anyio_backend: str, zk_url: str) -> None:
    """An attempt on a name held through the same backend is refused from what the
    backend knows: no request, no node written. Once the delete of a grant released
    here is written, the name is handed to the waiter of this backend behind it: a
    newcomer is refused with that waiter as the holder, and the waiter, which waited
    for that write (no watch of its own: its predecessor is a node of this backend),
    is granted without listing the queue."""

    async def scenario() -> None:
        async with await ZooKeeperBackend.from_url(zk_url, prefix=unique_prefix()) as zk:

            def sent() -> int:
                stats = zk.statistics()
                return stats.requests - stats.pings

            held = await zk.try_acquire("n", "h", 5, "holder", {})
            assert isinstance(held, Grant)
            before = sent()
            refused = await zk.try_acquire("n", "w", 5, "waiter", {})
            assert isinstance(refused, HolderInfo)
            assert (refused.owner, refused.token) == ("h", held.token)
            assert sent() == before and zk.statistics().local_refusals == 1
            waiting = asyncio.ensure_future(zk.wait_turn("n", "w", 5, refused))
            async with timeout_after(20):  # its node written: no event says so
                while zk.statistics().entries < 2:  # noqa: ASYNC110
                    await asyncio.sleep(0.001)
            queued = sent()
            assert queued == before + 2  # its create and the listing: no watch set
            release = zk.release_now("n", "h", held.token)
            assert release is not None
            # The delete is written, its reply not read: the waiter is next.
            newcomer = await zk.try_acquire("n", "x", 5, "newcomer", {})
            assert isinstance(newcomer, HolderInfo) and newcomer.owner == "w"
            assert sent() == queued + 1  # the delete, nothing for the newcomer
            await waiting  # woken by the delete's write
            grant = await zk.try_acquire("n", "w", 5, "waiter", {})
            assert isinstance(grant, Grant) and grant.token > held.token
            assert sent() == queued + 1 and zk.statistics().hand_offs == 1
            assert await release
            assert await zk.release("n", "w", grant.token)

    await on_asyncio(scenario)


async def test_a_waiter_behind_the_first_is_granted_without_a_listing(
    anyio_backend: str, zk_url: str
) -> None:
    """A waiter whose predecessor was the first of the queue when it was listed is
    first once that node is gone, whoever held it (nodes only join at the end): here
    the holder is another backend's session, and the waiter is granted on the watch
    event without listing the queue again."""
    prefix = unique_prefix()
    async with opener(zk_url, prefix=prefix)() as here, opener(zk_url, prefix=prefix)() as there:
        held = await AsyncLock(there, "first", ttl=5).acquire_nowait()
        waiter = AsyncLock(here, "first", ttl=5)
        async with anyio.create_task_group() as tg:
            got = anyio.Event()

            async def wait() -> None:
                async with waiter:
                    got.set()

            tg.start_soon(wait)
            await eventually(lambda: inner(here).statistics().entries == 1, "queued")
            before = inner(here).statistics()
            await held.release()
            with anyio.fail_after(10):
                await got.wait()
        # Granted by the `first` path (hand_offs counts only those), not a listing.
        assert inner(here).statistics().hand_offs == before.hand_offs + 1


def _count(outside: Outside, path: str, count: int) -> Callable[[], Awaitable[bool]]:
    return lambda: _children(outside, path, count)


async def _children(outside: Outside, path: str, count: int, exact: bool = False) -> bool:
    found = len(await outside.children(path))
    return found == count if exact else found >= count


async def _cancelled_waiter(lock: AsyncLock, scope: anyio.CancelScope) -> None:
    with scope:
        await lock.acquire()


async def test_names_never_share_a_node(anyio_backend: str, zk_url: str) -> None:
    layout = Layout("/p")
    names = [".", "..", "%2E", "a/b", "a%2Fb", "A", "a", " ", "é"]
    nodes = [layout.name_node(n) for n in names]
    assert len(set(nodes)) == len(names)
    assert all(n.count("/") == 2 and n.rsplit("/", 1)[1] not in (".", "..") for n in nodes)
    owner = unique("owner")
    async with opener(zk_url)() as backend:
        for name in names:
            grant = await backend.try_acquire(name, owner, 5, "me", {})
            assert isinstance(grant, Grant), name


async def test_wait_changed_sees_a_proclaim_made_before_its_watch(
    anyio_backend: str, zk_url: str
) -> None:
    """A waiter whose knowledge of the holder predates a proclaim (its own earlier read)
    returns at once: the rewrite happened before its watch was set, so no watch event
    would come. Regression: it waited for the session timeout."""
    open_ = opener(zk_url, session_timeout=30)
    async with open_() as holder_side, open_() as waiter:
        name = unique("proclaimed")
        granted = await holder_side.try_acquire(name, "holder", 30.0, "holder", {"v": "1"})
        assert isinstance(granted, Grant), granted
        seen = await waiter.read(name)
        assert seen is not None and dict(seen.metadata) == {"v": "1"}
        await holder_side.update_metadata(name, "holder", granted.token, {"v": "2"})
        with anyio.fail_after(10):  # a hang guard, well below the session timeout
            await waiter.wait_changed(name, seen)
        after = await waiter.read(name)
        assert after is not None and dict(after.metadata) == {"v": "2"}
