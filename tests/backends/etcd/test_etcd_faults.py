"""The etcd backend under watches and faults: observe through watches, a cluster
member killed, a connection that goes silent, against real etcd."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import anyio
import pytest

from aiolease import (
    AsyncLock,
    BackendError,
    Elector,
    Lease,
    LeaseLostError,
    LossReason,
)
from aiolease.abc import Grant, HolderInfo
from aiolease.backends.etcd import EtcdBackend
from aiolease.testing import FaultProxy
from aiolease.testing.etcd_cluster import EtcdCluster
from aiolease.testing.servers import server
from tests.backends.etcd.support import (
    LOOK_AGAIN,
    WAIT,
    Gateway,
    addresses,
    open_etcd,
    opener,
    unique_prefix,
)

pytestmark = pytest.mark.anyio


# -- watches ------------------------------------------------------------------------------


#: ``read`` calls, counted by :class:`CountingReads`.
CALLS: dict[str, int] = {}


class CountingReads(EtcdBackend):
    """Counts ``read`` calls in :data:`CALLS` under ``"read"``."""

    async def read(self, name: str) -> HolderInfo | None:
        CALLS["read"] = CALLS.get("read", 0) + 1
        return await super().read(name)


async def test_observe_follows_leaders_through_watches(anyio_backend: str, etcd_url: str) -> None:
    prefix = unique_prefix()
    seen: list[str | None] = []
    CALLS.clear()
    async with AsyncExitStack() as stack:
        watcher = await stack.enter_async_context(open_etcd(etcd_url, CountingReads, prefix=prefix))
        other = await stack.enter_async_context(open_etcd(etcd_url, prefix=prefix))
        changed = anyio.Event()

        async def observe() -> None:
            nonlocal changed
            async for leader in Elector(watcher, "e", ttl=30).observe():
                seen.append(None if leader is None else leader.identity)
                changed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(observe)
            for identity in ("a", "b", "c"):
                await changed.wait()
                changed = anyio.Event()
                lease = await AsyncLock(other, "e", ttl=30, identity=identity).acquire()
                await changed.wait()
                changed = anyio.Event()
                await lease.release()
            await changed.wait()
            tg.cancel_scope.cancel()
    assert seen == [None, "a", None, "b", None, "c", None]
    # One read per change seen, each after a watch fired: nothing polled.
    assert CALLS["read"] == len(seen)


# -- a cluster member dies ------------------------------------------------------------------


async def test_killing_the_leader_member_while_a_lease_is_held(
    anyio_backend: str, cluster_url: str
) -> None:
    cluster = EtcdCluster([f"{h}:{p}" for h, p in server("etcd-cluster").addresses])
    await cluster.wait_healthy(WAIT)
    open_ = opener(cluster_url)
    ttl = 5.0  # keepalives every 5/3 s; an election takes 1-2 s
    got: list[tuple[int, LossReason | None]] = []
    holding: list[Lease] = []
    outcome: list[LossReason] = []
    killed = None
    try:
        async with open_() as holder_backend, open_() as contender_backend:

            async def contend() -> None:
                while True:
                    try:
                        async with AsyncLock(contender_backend, "n", ttl=ttl) as lease:
                            # Never a double holder: the holder's lease is over by now.
                            got.append((lease.token, holding[0].lost))
                            return
                    except BackendError:
                        await anyio.sleep(0.1)  # no leader yet: try again

            async with anyio.create_task_group() as tg:
                try:
                    async with AsyncLock(holder_backend, "n", ttl=ttl) as lease:
                        holding.append(lease)
                        tg.start_soon(contend)
                        killed = await cluster.kill_leader()
                        await cluster.wait_leader(WAIT, excluding=killed)
                        # Held on by a keepalive sent after the election, or reported lost.
                        elected = anyio.current_time()
                        with anyio.fail_after(WAIT):
                            renewed_after = elected + ttl - lease.timing.margin
                            while lease.lost is None and lease.deadline < renewed_after:
                                with anyio.move_on_after(LOOK_AGAIN):  # no event for this
                                    await lease.wait_lost()
                    outcome.append(LossReason.RELEASED)
                except LeaseLostError as exc:
                    outcome.append(exc.reason)
    finally:
        if killed is not None:
            with anyio.CancelScope(shield=True):
                await cluster.restart(killed, WAIT)
    # Kept alive through the election, or reported lost: never silently gone.
    assert outcome in ([LossReason.RELEASED], [LossReason.EXPIRED], [LossReason.UNREACHABLE])
    assert len(got) == 1, (got, outcome)
    ((token, holder_state),) = got
    assert holder_state is not None
    assert token > holding[0].token


# -- a connection that goes silent ------------------------------------------------------------


async def test_cancelling_calls_on_a_silent_connection_is_clean(
    anyio_backend: str, single_url: str
) -> None:
    """grpc.aio re-raises a cancelled call as a bare ``CancelledError``, which anyio's
    scopes do not recognise as theirs: every call must still end in its scope."""
    host, port = addresses(single_url)[0]
    async with (
        FaultProxy(host, port) as proxy,
        open_etcd(proxy.url_for(single_url), prefix=unique_prefix()) as backend,
    ):
        grant = await backend.try_acquire("n", "o", 30, "me", {})
        assert isinstance(grant, Grant)
        seen = await backend.read("n")
        await proxy.blackhole()
        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "release": lambda: backend.release("n", "o", grant.token),
            "read": lambda: backend.read("n"),
            "wait_changed": lambda: backend.wait_changed("n", seen),
        }
        for what, call in calls.items():
            with anyio.move_on_after(0.2) as scope:
                await call()
            assert scope.cancelled_caught, what
        await proxy.pass_through()
        # The release held by the blackhole may arrive now: either way the name is freed.
        await backend.release("n", "o", grant.token)
        assert await backend.read("n") is None


async def test_a_key_whose_delete_went_unanswered_is_never_reused(
    anyio_backend: str, single_url: str
) -> None:
    """A delete held up on the way may reach etcd after anything sent later: the key it
    names must never be another attempt's."""
    host, port = addresses(single_url)[0]
    gateway = Gateway(single_url)
    prefix = unique_prefix()
    async with (
        FaultProxy(host, port) as proxy,
        open_etcd(proxy.url_for(single_url), prefix=prefix) as backend,
    ):
        grant = await backend.try_acquire("n", "o1", 30, "me", {})
        assert isinstance(grant, Grant)
        (first,) = await gateway.owners(prefix)
        await proxy.blackhole()
        with anyio.move_on_after(0.2) as scope:
            await backend.release("n", "o1", grant.token)
        assert scope.cancelled_caught
        await proxy.pass_through()
        await backend.release("n", "o1", grant.token)
        again = await backend.try_acquire("n", "o2", 30, "me", {})
        assert isinstance(again, Grant)
        owners = await gateway.owners(prefix)
        assert first not in owners and list(owners.values()) == ["o2"]
        assert await backend.release("n", "o2", again.token) is True


async def test_a_release_that_times_out_on_a_silent_connection_reports_false(
    anyio_backend: str, single_url: str
) -> None:
    """What the safety harness's blackhole hit: the shielded release's deadline cancels
    a gRPC call, and the cancellation must end in that scope, not crash the holder."""
    host, port = addresses(single_url)[0]
    async with (
        FaultProxy(host, port) as proxy,
        open_etcd(proxy.url_for(single_url), prefix=unique_prefix()) as backend,
    ):
        lease = await AsyncLock(backend, "n", ttl=30, release_timeout=0.3).acquire()
        await proxy.blackhole()
        with anyio.fail_after(WAIT):
            assert await lease.release() is False
        assert lease.lost is LossReason.RELEASED
        await proxy.pass_through()
