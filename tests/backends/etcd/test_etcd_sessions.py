"""The etcd backend's keys, sessions and ttls, and what ends its leases (a lost
session, closing the backend, cancellation storms), against real etcd."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from aiolease import (
    AsyncLock,
    Elector,
    Lease,
    LeaseLostError,
    LossReason,
)
from aiolease._holding import Counters, Holding
from aiolease.abc import Backend, Grant, HolderInfo, WrappingBackend
from aiolease.backends.etcd._wire import Limiter
from tests.backends.etcd.support import (
    LOOK_AGAIN,
    WAIT,
    Gateway,
    inner,
    open_etcd,
    opener,
    private_etcd,
    unique_prefix,
)

pytestmark = pytest.mark.anyio


# -- keys, sessions and ttls ------------------------------------------------------------


async def test_keys_layout(anyio_backend: str, single_url: str) -> None:
    open_ = opener(single_url)
    gateway = Gateway(single_url)
    async with open_() as backend:
        grant = await backend.try_acquire("a/b%c", "owner-1", 30, "host-1", {"k": "v"})
        assert isinstance(grant, Grant)
        await backend.try_acquire("a", "owner-2", 30, "host-2", {})
        keys = {kv["key"]: kv for kv in await gateway.keys(open_.prefix)}  # type: ignore[attr-defined]
        owners = await gateway.owners(open_.prefix)  # type: ignore[attr-defined]
        (mine,) = [kv for key, kv in keys.items() if owners[key] == "owner-1"]
        (theirs,) = [key for key in keys if owners[key] == "owner-2"]
        assert mine["key"].startswith(f"{open_.prefix}a%2Fb%25c/")  # type: ignore[attr-defined]
        assert theirs.startswith(f"{open_.prefix}a/")  # type: ignore[attr-defined]
        assert mine["create_revision"] == grant.token
        value = {"owner": "owner-1", "identity": "host-1", "metadata": {"k": "v"}}
        assert json.loads(mine["value"]) == value
        assert mine["lease"] in inner(backend).statistics().lease_ids


async def test_a_released_key_is_reused_and_names_its_owner(
    anyio_backend: str, single_url: str
) -> None:
    """Non-fair mode writes the next attempt into a key it saw deleted (etcd keeps every
    deleted key in its index until it compacts, and each acquire ranges over them);
    its value names the owner, which other backend objects read, watch and release."""
    open_ = opener(single_url)
    gateway = Gateway(single_url)
    prefix: str = open_.prefix  # type: ignore[attr-defined]
    async with open_() as backend, open_() as other:
        first = await backend.try_acquire("n", "owner-1", 30, "host-1", {})
        assert isinstance(first, Grant)
        (key,) = await gateway.owners(prefix)
        assert await backend.release("n", "owner-1", first.token) is True
        second = await backend.try_acquire("n", "owner-2", 30, "host-2", {"k": "v"})
        assert isinstance(second, Grant) and second.token > first.token
        (kv,) = await gateway.keys(prefix)
        assert kv["key"] == key
        value = {"owner": "owner-2", "identity": "host-2", "metadata": {"k": "v"}}
        assert json.loads(kv["value"]) == value
        holder = await other.read("n")
        assert holder is not None and (holder.owner, holder.token) == ("owner-2", second.token)
        refused = await other.try_acquire("n", "owner-3", 30, "host-3", {})
        assert isinstance(refused, HolderInfo) and refused.owner == "owner-2"
        assert await other.release("n", "owner-1", None) is False  # the key's first owner
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(other.wait_changed, "n", holder)  # watches the reused key
                assert await backend.release("n", "owner-2", second.token) is True
        assert await gateway.keys(prefix) == []
        # Released through another backend object, which finds the key by its value.
        third = await backend.try_acquire("n", "owner-4", 30, "host-4", {})
        assert isinstance(third, Grant)
        assert await gateway.owners(prefix) == {key: "owner-4"}
        assert await other.release("n", "owner-4", third.token + 1) is False
        assert await other.release("n", "owner-4", None) is True
        assert await gateway.keys(prefix) == []


async def test_keys_are_never_another_owners(anyio_backend: str, single_url: str) -> None:
    """A backend object's keys are its own: an owner id used again, or by another
    backend object, never names a key that another owner holds."""
    open_ = opener(single_url)
    gateway = Gateway(single_url)
    prefix: str = open_.prefix  # type: ignore[attr-defined]
    async with open_() as backend, open_() as other:
        for owner in ("owner-1", "owner-2", "owner-1"):
            grant = await backend.try_acquire("n", owner, 30, "me", {})
            assert isinstance(grant, Grant)
            assert await backend.release("n", owner, grant.token) is True
        held = await backend.try_acquire("n", "owner-2", 30, "me", {})
        assert isinstance(held, Grant)
        for owner in ("owner-1", "owner-2"):
            assert await other.release("n", owner, None) is (owner == "owner-2")
        assert await gateway.keys(prefix) == []


async def test_a_refused_attempt_gives_its_key_back(anyio_backend: str, single_url: str) -> None:
    """A refused attempt wrote nothing: its compensating release leaves the holder
    alone, and a later attempt reuses its key."""
    open_ = opener(single_url)
    gateway = Gateway(single_url)
    prefix: str = open_.prefix  # type: ignore[attr-defined]
    async with open_() as backend, open_() as other:
        held = await other.try_acquire("n", "holder", 30, "them", {})
        assert isinstance(held, Grant)
        (theirs,) = await gateway.owners(prefix)
        for owner in ("owner-1", "owner-2"):
            refused = await backend.try_acquire("n", owner, 30, "me", {})
            assert isinstance(refused, HolderInfo) and refused.owner == "holder"
            assert await backend.release("n", owner, None) is False
        assert await gateway.owners(prefix) == {theirs: "holder"}
        assert await other.release("n", "holder", held.token) is True
        again = await backend.try_acquire("n", "owner-3", 30, "me", {})
        assert isinstance(again, Grant)
        (mine,) = await gateway.owners(prefix)
        assert mine != theirs
        assert await backend.release("n", "owner-3", again.token) is True
        refused = await other.try_acquire("n", "holder", 30, "them", {})  # takes theirs again
        assert isinstance(refused, Grant)
        assert await gateway.owners(prefix) == {theirs: "holder"}
        for owner in ("owner-4", "owner-5"):
            assert isinstance(await backend.try_acquire("n", owner, 30, "me", {}), HolderInfo)
        assert await other.release("n", "holder", refused.token) is True
        last = await backend.try_acquire("n", "owner-5", 30, "me", {})
        assert isinstance(last, Grant)
        assert await gateway.owners(prefix) == {mine: "owner-5"}  # one key per backend so far


@pytest.mark.parametrize(("ttl", "granted"), [(0.5, 2), (2.5, 3), (7.0, 7)])
async def test_granted_ttl_is_whole_seconds_and_at_least_the_minimum(
    anyio_backend: str, single_url: str, ttl: float, granted: int
) -> None:
    gateway = Gateway(single_url)
    async with opener(single_url)() as backend:
        sent = anyio.current_time()
        lease = await AsyncLock(backend, "n", ttl=ttl).acquire()
        answered = anyio.current_time()
        (kv,) = await gateway.keys(inner(backend).prefix)
        remaining, server_ttl = await gateway.lease_ttl(kv["lease"])
        assert server_ttl == granted  # etcd's minimum is 2 s with a 1 s election timeout
        assert 0 < remaining <= granted
        # The local deadline counts the smaller of the asked and the granted ttl.
        good_for = min(ttl, granted) - lease.timing.margin
        assert sent + good_for <= lease.deadline <= answered + good_for
        await lease.release()


async def test_one_session_per_ttl_carries_every_lease(anyio_backend: str, single_url: str) -> None:
    open_ = opener(single_url)
    gateway = Gateway(single_url)
    async with open_() as backend:
        for i in range(20):
            assert isinstance(await backend.try_acquire(f"n{i}", "o", 5, "me", {}), Grant)
        await backend.try_acquire("other", "o", 9, "me", {})
        keys = await gateway.keys(open_.prefix)  # type: ignore[attr-defined]
        by_lease: dict[int, int] = {}
        for kv in keys:
            by_lease[kv["lease"]] = by_lease.get(kv["lease"], 0) + 1
        assert sorted(by_lease.values()) == [1, 20]
        assert set(by_lease) == set(inner(backend).statistics().lease_ids)


async def test_holding_many_leases_costs_one_keepalive_per_tick(
    anyio_backend: str, single_url: str
) -> None:
    """Held leases ride on the session: the core never renews them, and their
    deadlines follow the session's keepalives."""
    ttl, count = 1.5, 25  # granted 2 s: a keepalive every 2/3 s
    async with opener(single_url)() as backend:
        stats = inner(backend).statistics
        leases: list[Lease] = []
        async with AsyncExitStack() as stack:
            for i in range(count):
                leases.append(await stack.enter_async_context(AsyncLock(backend, f"n{i}", ttl=ttl)))
            first = [lease.deadline for lease in leases]
            await _kept_alive(backend, 3)
            assert all(lease.lost is None for lease in leases)
            assert all(lease.deadline > was for lease, was in zip(leases, first, strict=True))
            assert all(lease.renewals == 0 for lease in leases)  # the session kept them
        assert len(stats().lease_ids) == 1


async def test_holding_many_leases_costs_no_requests_per_lease(
    anyio_backend: str, tmp_path: Path
) -> None:
    """200 leases held: etcd receives the session's keepalives and nothing else. The
    core's own takeover watch would read and watch each lease every ttl (~130 requests
    a second here); the backend watches all their keys on one stream instead."""
    count, ttl = 200, 3.0  # granted 3 s: a keepalive every second
    async with private_etcd(tmp_path / "etcd") as etcd:
        gateway = Gateway(etcd.url)
        async with open_etcd(etcd.url, prefix=unique_prefix()) as backend:
            leases: list[Lease] = []
            async with AsyncExitStack() as stack:
                for i in range(count):
                    lock = AsyncLock(backend, f"n{i}", ttl=ttl)
                    leases.append(await stack.enter_async_context(lock))
                await _kept_alive(backend, 1)  # the watchers are sent (after 20 ms)
                before, started = await gateway.requests(), anyio.current_time()
                await _kept_alive(backend, 3)
                after, elapsed = await gateway.requests(), anyio.current_time() - started
                assert all(lease.lost is None for lease in leases)
    sent = {m: n - before.get(m, 0) for m, n in after.items() if n > before.get(m, 0)}
    keepalives = elapsed / (ttl / 3) + 2
    assert set(sent) <= {"LeaseKeepAlive"}, sent
    assert 1 <= sum(sent.values()) <= keepalives, (sent, elapsed)


async def _kept_alive(backend: Backend, times: int) -> None:
    """Wait until the backend's sessions have sent ``times`` more keepalives (no event
    marks one)."""
    stats = inner(backend).statistics
    until = stats().keepalives + times
    with anyio.fail_after(WAIT):
        while stats().keepalives < until:  # noqa: ASYNC110
            await anyio.sleep(LOOK_AGAIN)


async def test_a_deleted_key_ends_its_lease_at_once(anyio_backend: str, single_url: str) -> None:
    """An operator deletes one held key: that lease ends ``STOLEN`` long before any
    renewal or ttl would tell; the others on the same session and stream go on."""
    open_ = opener(single_url)
    prefix: str = open_.prefix  # type: ignore[attr-defined]
    gateway = Gateway(single_url)
    async with open_() as backend:
        other = await AsyncLock(backend, "other", ttl=30).acquire()
        async with Holding(other, Counters()):
            with anyio.fail_after(WAIT), pytest.raises(LeaseLostError) as info:
                async with AsyncLock(backend, "victim", ttl=30) as lease:
                    owners = await gateway.owners(f"{prefix}victim/")
                    (key,) = [key for key, owner in owners.items() if owner == lease.owner]
                    await gateway.delete(key)
                    await anyio.sleep_forever()
            assert info.value.reason is LossReason.STOLEN
            assert other.lost is None
            assert await backend.read("other") is not None
        again = await AsyncLock(backend, "victim", ttl=30).acquire_nowait()
        assert again.token > lease.token
        await again.release()


# -- losing and closing ------------------------------------------------------------------


async def test_a_lost_session_ends_its_leases_and_a_new_one_serves(
    anyio_backend: str, etcd_url: str
) -> None:
    gateway = Gateway(etcd_url)
    async with opener(etcd_url)() as backend:
        lock = AsyncLock(backend, "n", ttl=30)
        with anyio.fail_after(WAIT), pytest.raises(LeaseLostError) as info:
            async with lock as lease:
                (session,) = inner(backend).statistics().lease_ids
                await gateway.revoke(session)  # as an operator, or a server that lost it
                await anyio.sleep_forever()  # cancelled at once, long before the ttl
        assert info.value.reason is LossReason.STOLEN
        assert lease.lost is LossReason.STOLEN
        again = await lock.acquire()
        assert again.token > lease.token
        assert inner(backend).statistics().lease_ids != (session,)
        assert inner(backend).statistics().sessions_lost == 1
        await again.release()


async def test_closing_the_backend_ends_its_leases_first(anyio_backend: str, etcd_url: str) -> None:
    open_ = opener(etcd_url)
    gateway = Gateway(etcd_url)
    reasons: list[LossReason] = []
    async with open_() as backend:
        lease_ids: tuple[int, ...] = ()
        inside = anyio.Event()

        async def hold() -> None:
            try:
                async with AsyncLock(backend, "n", ttl=30) as lease:
                    inside.set()
                    await anyio.sleep_forever()
            except LeaseLostError as exc:
                reasons.append(exc.reason)
                assert lease.lost is LossReason.SHUTDOWN

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            # In the block (the key on the server is not enough: under trio the grant's
            # reply may not have reached the block yet, and a lease the core has not
            # taken up when its backend closes is reported as taken from it).
            await inside.wait()
            lease_ids = inner(backend).statistics().lease_ids
            await backend.aclose()
    assert reasons == [LossReason.SHUTDOWN]
    assert await gateway.keys(open_.prefix) == []  # type: ignore[attr-defined]
    for lease_id in lease_ids:
        assert (await gateway.lease_ttl(lease_id))[0] == -1  # revoked


class _ClosesAfterTheGrant(WrappingBackend):
    """Closes itself (and the backend it wraps) as soon as a grant comes back: the
    backend closes between the grant and the block taking the lease up."""

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        answer = await self.inner.try_acquire(name, owner, ttl, identity, metadata)
        if isinstance(answer, Grant):
            await self.aclose()
        return answer


async def test_a_grant_the_backend_closed_under_ends_with_shutdown(
    anyio_backend: str, etcd_url: str
) -> None:
    """The backend closes after the grant, before the block took the lease up (the
    session backend then refuses to keep it): the lease ends ``SHUTDOWN``, with its
    backend, not ``STOLEN`` as if somebody had taken it."""
    async with opener(etcd_url)() as inner:
        backend = _ClosesAfterTheGrant(inner)
        with pytest.raises(LeaseLostError) as lost:
            async with AsyncLock(backend, "n", ttl=30):
                await anyio.sleep_forever()  # (cancelled at once: the lease is gone)
        assert lost.value.reason is LossReason.SHUTDOWN


async def _storm(backend: Backend, name: str, rounds: int, seed: int) -> int:
    """Acquire ``name`` over and over, cancelled at every stage; how many got in."""
    rng = random.Random(seed)
    got = 0
    for _ in range(rounds):
        with anyio.move_on_after(rng.choice([0, 0.001, 0.003, 0.01, 0.03])):
            async with AsyncLock(backend, name, ttl=rng.choice([3.0, 7.0])):
                got += 1
                await anyio.sleep(rng.choice([0, 0.005, 0.02]))
    return got


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
async def test_cancellation_storms_leak_no_keys_or_leases(
    anyio_backend: str, etcd_url: str, fair: bool
) -> None:
    open_ = opener(etcd_url, fair=fair)
    gateway = Gateway(etcd_url)
    before = await gateway.leases()
    async with open_() as one, open_() as two:
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(_storm, (one, two)[i % 2], "n", 15, i)
        # Every key is gone; what is left of the sessions is known to the backends.
        assert await gateway.keys(open_.prefix) == []  # type: ignore[attr-defined]
        ours = set(inner(one).statistics().lease_ids) | set(inner(two).statistics().lease_ids)
        assert ours <= await gateway.leases()
        assert len(ours) <= 4  # one per ttl and backend: no lease per attempt
    leaked = await gateway.leases() - before - ours
    for lease_id in leaked:  # others' leases appear too; ours have the storm's odd TTLs
        remaining, granted = await gateway.lease_ttl(lease_id)
        assert remaining == -1 or granted not in (3, 7), f"leaked lease {lease_id:x}"
    for lease_id in ours:
        assert (await gateway.lease_ttl(lease_id))[0] == -1


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
async def test_a_cancelled_campaign_leaves_no_key(
    anyio_backend: str, single_url: str, fair: bool
) -> None:
    open_ = opener(single_url, fair=fair)
    prefix: str = open_.prefix  # type: ignore[attr-defined]
    gateway = Gateway(single_url)

    async def work(lease: Lease) -> None:
        raise AssertionError("elected while the name is held")  # pragma: no cover

    async with open_() as backend:
        holder = await AsyncLock(backend, "e", ttl=30).acquire()
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(Elector(backend, "e", ttl=30, identity=f"c{i}").run, work)
            if fair:
                await gateway.wait_keys(prefix, 4)  # every candidate is in the queue
            else:
                await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
        assert list((await gateway.owners(prefix)).values()) == [holder.owner]
        await holder.release()
        assert await gateway.keys(prefix) == []


# Thousands of leases: once, under asyncio (the etcd backend's own loop).
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_many_bodies_ending_at_once_lose_nothing(
    anyio_backend: str, single_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3,000 held leases whose bodies all end in the same instant: none is reported
    lost, and every key is gone once the last ``async with`` is left.

    Every exit starts its release in the same loop turn, and no keepalive can run before
    that turn ends: the leases' deadlines must outlast it, and then the releases must
    not starve the session's keepalive nor overload the server (they queue for a place
    among the wire's requests in flight)."""
    count, ttl = 3000, 3.0
    open_ = opener(single_url)
    prefix: str = open_.prefix  # type: ignore[attr-defined]
    gateway = Gateway(single_url)
    lost: list[LeaseLostError] = []
    async with open_() as backend:
        stop = anyio.Event()
        # KV requests this backend sends (alone, or a batch of deletes), counted on its
        # side: the server's counters would count other tests' too.
        wire = inner(backend)._wire
        placed = wire._placed
        sent = 0

        async def counted(*args: Any) -> Any:
            nonlocal sent
            sent += 1
            return await placed(*args)

        monkeypatch.setattr(wire, "_placed", counted)

        async def hold(i: int, task_status: anyio.abc.TaskStatus[None]) -> None:
            try:
                async with AsyncLock(backend, f"n{i}", ttl=ttl):
                    task_status.started()
                    await stop.wait()
            except LeaseLostError as exc:
                lost.append(exc)

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                for start in range(0, count, 50):  # fifty acquires at a time
                    async with anyio.create_task_group() as batch:
                        for i in range(start, start + 50):
                            batch.start_soon(_started, tg, hold, i)
                before = sent
                stop.set()
            assert lost == []
            assert await gateway.keys(prefix) == []
        # The releases that found every place for requests in flight taken went in
        # batches: far fewer requests than releases (one each before).
        assert sent - before < count / 2, sent - before
        assert inner(backend).statistics().delete_batches > 0


async def _started(tg: anyio.abc.TaskGroup, func: Any, i: int) -> None:
    await tg.start(func, i)


async def test_requests_queued_for_a_place_may_be_cancelled(
    anyio_backend: str, single_url: str
) -> None:
    """With two places for requests in flight, 60 acquire-and-release rounds at once,
    a third of them cancelled at once and another third soon (while queued, or while
    being handed a place): a place is never lost, every name is free again, and the
    backend still serves."""
    open_ = opener(single_url)
    prefix: str = open_.prefix  # type: ignore[attr-defined]
    gateway = Gateway(single_url)
    async with open_() as backend:
        inner(backend)._wire._limiter = Limiter(2)

        async def round_(i: int) -> None:
            lock = AsyncLock(backend, f"n{i}", ttl=3)
            if i % 3 == 0:
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    await lock.acquire()
                return
            with anyio.move_on_after(0.005 if i % 3 == 1 else WAIT):
                async with lock:
                    pass

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                for i in range(60):
                    tg.start_soon(round_, i)
            async with AsyncLock(backend, "after", ttl=30):
                pass
            while await gateway.keys(prefix):  # noqa: ASYNC110 (cancelled ones lapse later)
                await anyio.sleep(LOOK_AGAIN)
        assert inner(backend)._wire._limiter.free == 2
