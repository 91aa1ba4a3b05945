"""Permits (semaphores, read-write locks) on real etcd: what the conformance suite
cannot see from outside one backend object. Two backend objects stand for two
processes; the server is inspected through its HTTP/JSON gateway."""

from __future__ import annotations

import asyncio
import base64
import json
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest

from aiolease import (
    AsyncSemaphore,
    BackendUnavailable,
    ForeignDataError,
    LeaseLostError,
    LossReason,
)
from aiolease.abc import Grant, HolderInfo, permit_owner
from tests.backends.etcd.support import (
    LOOK_AGAIN,
    WAIT,
    Gateway,
    inner,
    open_etcd,
    opener,
    private_etcd,
    raises,
    unique_prefix,
)
from tests.backends.safety import race_for_permits

pytestmark = pytest.mark.anyio
LONG = 30.0


async def test_two_backends_never_hold_more_than_the_limit(
    anyio_backend: str, etcd_url: str
) -> None:
    """Tasks on two backend objects share a limit of 2: never more inside at once, a
    waiter on one is woken by a release on the other, and every grant takes a new,
    larger token (a create revision)."""
    inside, peak, tokens = 0, 0, []
    full = anyio.Event()
    open_ = opener(etcd_url)
    async with open_() as first, open_() as second:

        async def body(backend: object) -> None:
            nonlocal inside, peak
            async with AsyncSemaphore(backend, "n", limit=2, ttl=LONG) as permit:  # type: ignore[arg-type]
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
                for backend in (first, second, first, second):
                    tg.start_soon(body, backend)
        assert peak == 2
        assert len(set(tokens)) == 4
        assert await second.read_permits("n") is None


async def test_a_permit_is_a_key_whose_create_revision_is_its_token(
    anyio_backend: str, single_url: str
) -> None:
    """Each request's keys are in a slot of the backend's (``permit:<random>.<n>``, its
    queue key ``permit:q`` and that), the value names the owner; a queued request's
    grant replaces its queue key by the permit key of the same slot, a new token."""
    open_ = opener(single_url)
    gateway = Gateway(single_url)
    async with open_() as backend:
        owners = [permit_owner() for _ in range(3)]
        tokens = []
        for owner in owners[:2]:
            grant = await backend.try_acquire_permit("a/b", owner, LONG, "host", {}, 2, 1)
            assert isinstance(grant, Grant)
            tokens.append(grant.token)
        refused = await backend.try_acquire_permit("a/b", owners[2], LONG, "host", {}, 2, 1)
        assert isinstance(refused, HolderInfo) and refused.owner == owners[0]
        assert tokens[0] < tokens[1]
        keys = await gateway.keys(open_.prefix)  # type: ignore[attr-defined]
        by_owner = {json.loads(kv["value"])["owner"]: kv for kv in keys}
        assert set(by_owner) == set(owners)
        start = f"{open_.prefix}%permits/a%2Fb/"  # type: ignore[attr-defined]
        slots = {owner: kv["key"].removeprefix(start) for owner, kv in by_owner.items()}
        assert all(slot.startswith("permit:") and slot not in owners for slot in slots.values())
        queued = slots[owners[2]]
        assert queued.startswith("permit:qpermit:")  # a queued request's key
        for owner, token in zip(owners, tokens, strict=False):
            kv = by_owner[owner]
            assert kv["create_revision"] == token
            assert kv["lease"] in inner(backend).statistics().lease_ids
        values = [json.loads(by_owner[owner]["value"]) for owner in owners]
        assert [v["queued"] for v in values] == [False, False, True]
        assert {(v["limit"], v["weight"]) for v in values} == {(2, 1)}
        # Its turn: the queue key gives way to a permit key, a new (larger) token.
        assert await backend.release("a/b", owners[0], tokens[0])
        grant = await backend.try_acquire_permit("a/b", owners[2], LONG, "host", {}, 2, 1)
        assert isinstance(grant, Grant)
        assert grant.token > by_owner[owners[2]]["create_revision"]
        after = {kv["key"].removeprefix(start) for kv in await gateway.keys(open_.prefix)}  # type: ignore[attr-defined]
        assert after == {slots[owners[1]], queued.removeprefix("permit:q")}
        # A lock of the same name lives apart.
        assert isinstance(await backend.try_acquire("a/b", "lock-owner", LONG, "h", {}), Grant)


async def test_a_name_s_permits_reuse_a_bounded_set_of_keys(
    anyio_backend: str, single_url: str
) -> None:
    """Hundreds of requests of one name through one backend, granted at once or queued
    first, write a handful of distinct keys: each request's keys are in a slot of the
    backend's, reused once its keys are deleted. etcd keeps every deleted key in its
    index until compaction, and each acquire ranges over the name's keys: a key per
    request (the owner id in the key, before) made every acquire slower, without end
    (807 acquisitions a second in the first second, 463 in the eighth, with 16 tasks on
    a semaphore of 4). The history is read by a watch, deleted keys included."""
    name, cycles, rounds = "churn", 200, 20
    open_ = opener(single_url)
    gateway = Gateway(single_url)
    async with open_() as backend:
        sem = AsyncSemaphore(backend, name, limit=2, ttl=LONG)
        after = await gateway.revision()
        tokens: list[int] = []
        with anyio.fail_after(WAIT):
            for _ in range(cycles):  # granted at once
                async with sem as permit:
                    tokens.append(permit.token)

            async def queued(owner: str, refused: HolderInfo) -> None:
                """As the core does: wait for its turn, try again, until granted."""
                result: Grant | HolderInfo = refused
                while not isinstance(result, Grant):
                    await backend.wait_permit_turn(name, owner, LONG, result)
                    result = await backend.try_acquire_permit(name, owner, LONG, "w", {}, 2, 1)
                tokens.append(result.token)
                assert await backend.release(name, owner, result.token)

            for _ in range(rounds):  # two held, three queued behind them
                held = [await sem.acquire() for _ in range(2)]
                owners = [permit_owner() for _ in range(3)]
                refusals = await _refuse(backend, name, owners, 2)
                async with anyio.create_task_group() as tg:
                    for owner in owners:
                        tg.start_soon(queued, owner, refusals[owner])
                    for lease in held:
                        tokens.append(lease.token)
                        await lease.release()
        assert await backend.read_permits(name) is None
        prefix: str = open_.prefix  # type: ignore[attr-defined]
        start = f"{prefix}%permits/{name}/"
        written = [key for key in await gateway.written(prefix, after) if key.startswith(start)]
    assert len(tokens) == cycles + 5 * rounds
    assert len(set(tokens)) == len(tokens)
    slots = Counter(key.removeprefix(start) for key in written)
    queue_slots = [slot for slot in slots if slot.startswith("permit:qpermit:")]
    assert len(queue_slots) >= 1  # (the queued requests were queued)
    # At most 5 requests at once (2 held, 3 queued): 5 slots, each 2 keys (held, queued).
    assert len(slots) <= 10, sorted(slots.items(), key=lambda item: -item[1])[:20]
    assert sum(slots.values()) >= cycles + 5 * rounds  # (every grant is a put)


async def test_a_lost_session_ends_its_permits(anyio_backend: str, single_url: str) -> None:
    gateway = Gateway(single_url)
    async with opener(single_url)() as backend:
        sem = AsyncSemaphore(backend, "n", limit=3, ttl=LONG)
        with anyio.fail_after(WAIT), pytest.raises(LeaseLostError) as info:
            async with sem as permit:
                (session,) = inner(backend).statistics().lease_ids
                await gateway.revoke(session)
                await anyio.sleep_forever()  # cancelled at once, long before the ttl
        assert info.value.reason is LossReason.STOLEN
        assert await backend.read_permits("n") is None
        again = await sem.acquire()
        assert again.token > permit.token
        await again.release()


@pytest.mark.parametrize(
    "value",
    [
        b"not json",
        b'{"identity": "them"}',
        b'{"identity": "t", "metadata": {}, "limit": "2", "weight": 1, "queued": false}',
    ],
    ids=["not-json", "fields-missing", "limit-a-string"],
)
async def test_a_foreign_permit_key_is_refused_and_left_alone(
    anyio_backend: str, single_url: str, value: bytes
) -> None:
    """A key under the permits' prefix that aiolease did not write: reading and asking
    raise ForeignDataError naming the name, and the key is left as it was."""
    open_ = opener(single_url)
    gateway = Gateway(single_url)
    async with open_() as backend:
        await backend.read_permits("x")  # connected: the prefix is the test's own
        key = f"{open_.prefix}%permits/x/{permit_owner()}"  # type: ignore[attr-defined]
        body = {"key": base64.b64encode(key.encode()).decode()}
        await gateway.post("/v3/kv/put", {**body, "value": base64.b64encode(value).decode()})
        for attempt in (
            lambda: backend.read_permits("x"),
            lambda: backend.try_acquire_permit("x", permit_owner(), LONG, "p", {}, 2, 1),
        ):
            with raises(ForeignDataError, "did not write"):
                await attempt()
        assert [kv["value"] for kv in await gateway.keys(key)] == [value]


async def test_a_retry_after_a_lost_reply_finds_its_key_whose_slot_is_not_reused(
    anyio_backend: str, single_url: str
) -> None:
    """The reply to a permit's put is lost (the put was applied): the retry finds the
    request's own key, by the slot the backend keeps for it, and gets its grant, with
    no second key; once released, that slot (a request of it was in doubt) is not
    given to the next request, whose key is in a slot of its own."""
    open_ = opener(single_url)
    gateway = Gateway(single_url)
    name, owner, other = "lost", permit_owner(), permit_owner()
    async with open_() as backend:
        wire = inner(backend)._wire
        send = wire.txn

        async def reply_lost(request: Any) -> Any:
            wire.txn = send  # type: ignore[method-assign]
            await send(request)
            raise BackendUnavailable("etcd: the reply was lost (the test's)")

        wire.txn = reply_lost  # type: ignore[method-assign]
        with raises(BackendUnavailable, "the test's"):
            await backend.try_acquire_permit(name, owner, LONG, "h", {}, 2, 1)
        (kv,) = await gateway.keys(open_.prefix)  # type: ignore[attr-defined]
        assert json.loads(kv["value"])["owner"] == owner
        grant = await backend.try_acquire_permit(name, owner, LONG, "h", {}, 2, 1)
        assert isinstance(grant, Grant) and grant.token == kv["create_revision"]
        assert [k["key"] for k in await gateway.keys(open_.prefix)] == [kv["key"]]  # type: ignore[attr-defined]
        assert await backend.release(name, owner, grant.token)
        again = await backend.try_acquire_permit(name, other, LONG, "h", {}, 2, 1)
        assert isinstance(again, Grant)
        (new,) = await gateway.keys(open_.prefix)  # type: ignore[attr-defined]
        assert json.loads(new["value"])["owner"] == other and new["key"] != kv["key"]
        assert await backend.release(name, other, again.token)


async def test_keys_of_the_older_layout_are_read_as_their_owners(
    anyio_backend: str, single_url: str
) -> None:
    """Keys written by an older version (the owner id in the key, none in the value)
    are counted as the permit and the queued request they are, and reported with that
    owner: a request behind them waits until they are gone."""
    open_ = opener(single_url)
    gateway = Gateway(single_url)
    holder, waiting = permit_owner(), permit_owner()
    start = f"{open_.prefix}%permits/old/"  # type: ignore[attr-defined]
    old = {
        start + holder: {"queued": False},
        start + "permit:q" + waiting: {"queued": True},  # queued after the holder
    }
    async with open_() as backend:
        await backend.read_permits("old")  # connected: the prefix is the test's own
        for key, fields in old.items():
            value = {"identity": "older", "metadata": {}, "limit": 2, "weight": 1, **fields}
            body = {"key": base64.b64encode(key.encode()).decode()}
            body["value"] = base64.b64encode(json.dumps(value).encode()).decode()
            await gateway.post("/v3/kv/put", body)
        permits = await backend.read_permits("old")
        assert permits is not None and permits.waiting == 1
        assert [h.owner for h in permits.holders] == [holder]
        owner = permit_owner()
        refused = await backend.try_acquire_permit("old", owner, LONG, "new", {}, 2, 1)
        assert isinstance(refused, HolderInfo) and refused.owner == holder
        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(backend.wait_permit_turn, "old", owner, LONG, refused)
                await anyio.wait_all_tasks_blocked()
                await gateway.delete(start + holder)  # the older holder's release
        grant = await backend.try_acquire_permit("old", owner, LONG, "new", {}, 2, 1)
        assert isinstance(grant, Grant)  # behind the older queued request, within 2
        assert await backend.release("old", owner, grant.token)
        await gateway.delete(start + "permit:q" + waiting)
        assert await backend.read_permits("old") is None


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the backend's races, not the loop's
async def test_a_storm_of_requests_is_served_without_giving_up(
    anyio_backend: str, single_url: str
) -> None:
    """32 tasks take one of 2 permits 8 times each, with no hold: every request races
    others for a free permit. A request that loses its race twice queues (its turn comes
    by its queue key) instead of racing on until it gave up with BackendUnavailable
    ("kept changing": 17 of 320 such requests, before), and every task is served."""
    async with opener(single_url)() as backend:
        await race_for_permits(AsyncSemaphore(backend, "storm", limit=2, ttl=LONG), wait=WAIT)


async def test_an_uncontended_permit_acquire_is_one_txn(anyio_backend: str, tmp_path: Path) -> None:
    """One round trip, as a lock's: a txn guarded on the name having no key (it was a
    range, then a txn). A node of the test's own: its request counters are the test's."""
    async with private_etcd(tmp_path / "etcd") as etcd:
        gateway = Gateway(etcd.url)
        async with open_etcd(etcd.url, prefix=unique_prefix()) as backend:
            warm = await backend.try_acquire_permit("warm", permit_owner(), LONG, "h", {}, 2, 1)
            assert isinstance(warm, Grant)  # the session lease exists from here
            before = await gateway.requests()
            grant = await backend.try_acquire_permit("free", permit_owner(), LONG, "h", {}, 2, 1)
            after = await gateway.requests()
    assert isinstance(grant, Grant)
    sent = {m: after.get(m, 0) - before.get(m, 0) for m in ("Range", "Txn")}
    assert sent == {"Range": 0, "Txn": 1}


def _count_requests(backend: object) -> Counter[str]:
    """Count the KV requests (txn, range, delete) of the EtcdBackend behind ``backend``."""
    wire = inner(backend)._wire  # type: ignore[arg-type]
    sent: Counter[str] = Counter()
    for kind in ("txn", "range", "delete"):
        call = getattr(wire, kind)

        async def counted(request: Any, call: Any = call, kind: str = kind) -> Any:
            sent[kind] += 1
            return await call(request)

        setattr(wire, kind, counted)
    return sent


async def test_a_release_hands_the_permit_to_the_request_queued_first(
    anyio_backend: str, single_url: str
) -> None:
    """A release through the backend that the first queued request waits on deletes the
    permit key and gives that request its place in one transaction: its wait ends, and
    its next attempt takes the grant (a new token) without a request; the request behind
    it waits on for its own turn. A request that gives up after it was handed a place
    (a cancelled acquire's undo) leaves nothing held."""
    name = "handoff"
    holder, first, second = (permit_owner() for _ in range(3))
    async with opener(single_url)() as backend:
        held = await backend.try_acquire_permit(name, holder, LONG, "h", {}, 1, 1)
        assert isinstance(held, Grant)
        refusals: dict[str, HolderInfo] = {}
        for owner in (first, second):
            refused = await backend.try_acquire_permit(name, owner, LONG, "w", {}, 1, 1)
            assert isinstance(refused, HolderInfo)
            refusals[owner] = refused
        sent = _count_requests(backend)
        woken: list[str] = []
        turn = {owner: anyio.Event() for owner in (first, second)}

        async def wait(owner: str) -> None:
            await backend.wait_permit_turn(name, owner, LONG, refusals[owner])
            woken.append(owner)
            turn[owner].set()

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                for owner in (first, second):
                    tg.start_soon(wait, owner)
                await anyio.wait_all_tasks_blocked()  # both wait: candidates for a hand-off
                assert await backend.release(name, holder, held.token)
                await turn[first].wait()
                granted = await backend.try_acquire_permit(name, first, LONG, "w", {}, 1, 1)
                assert isinstance(granted, Grant) and granted.token > held.token
                assert sent == {"txn": 1} and woken == [first], (sent, woken)
                assert await backend.release(name, first, granted.token)  # to the second
                await turn[second].wait()
                assert sent == {"txn": 2}, sent
                assert await backend.release(name, second, None)  # gives up its grant
        assert await backend.read_permits(name) is None


async def test_releases_applied_out_of_order_both_hand_their_places_on(
    anyio_backend: str, single_url: str
) -> None:
    """Two releases here at once, each handing its place to a waiting request: etcd may
    apply their transactions in either order. The one applied first grants the first
    request, the other the second, and neither is sent again (the later release's
    transaction, applied first, used to fail for the first request's queue key, still
    there, and went again once the other was over: three transactions)."""
    name = "out-of-order"
    holders, waiting = [permit_owner() for _ in range(2)], [permit_owner() for _ in range(2)]
    async with opener(single_url)() as backend:
        held = [await backend.try_acquire_permit(name, h, LONG, "h", {}, 2, 1) for h in holders]
        refusals: dict[str, HolderInfo] = {}
        for owner in waiting:
            refused = await backend.try_acquire_permit(name, owner, LONG, "w", {}, 2, 1)
            assert isinstance(refused, HolderInfo)
            refusals[owner] = refused
        wire = inner(backend)._wire
        send, sent, later = wire.txn, Counter[str](), []

        async def first_held_back(request: Any) -> Any:
            """The first transaction goes once a later one is answered (in the wire's loop)."""
            sent["txn"] += 1
            if sent["txn"] == 1:
                later.append(asyncio.Event())
                await later[0].wait()
                return await send(request)
            reply = await send(request)
            later[0].set()
            return reply

        wire.txn = first_held_back  # type: ignore[method-assign]
        turn = {owner: anyio.Event() for owner in waiting}

        async def wait(owner: str) -> None:
            await backend.wait_permit_turn(name, owner, LONG, refusals[owner])
            turn[owner].set()

        async def release(holder: str, grant: Grant | HolderInfo) -> None:
            assert isinstance(grant, Grant)
            assert await backend.release(name, holder, grant.token)

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                for owner in waiting:
                    tg.start_soon(wait, owner)
                await anyio.wait_all_tasks_blocked()  # both wait: candidates for a hand-off
                async with anyio.create_task_group() as releases:
                    for holder, grant in zip(holders, held, strict=True):
                        releases.start_soon(release, holder, grant)
            assert sent == {"txn": 2}, sent  # each release one txn, both hand-offs
            granted = [
                await backend.try_acquire_permit(name, owner, LONG, "w", {}, 2, 1)
                for owner in waiting
            ]
            assert sent == {"txn": 2}, sent  # the grants: no request
            first, second = granted
            assert isinstance(first, Grant) and isinstance(second, Grant)
            assert max(g.token for g in held if isinstance(g, Grant)) < first.token
            assert first.token < second.token  # in queue order
            permits = await backend.read_permits(name)
            assert permits is not None and permits.waiting == 0
            assert {h.owner for h in permits.holders} == set(waiting)
            for owner, grant in zip(waiting, granted, strict=True):
                await release(owner, grant)
        assert await backend.read_permits(name) is None


async def test_a_hand_off_passes_a_request_that_fits_already(
    anyio_backend: str, single_url: str
) -> None:
    """A request whose watch found that it fits (a release elsewhere freed a permit),
    and that asks for its grant now, does not stop a release here from handing its own
    place to the next request: both fit, so both are granted, and nobody is over the
    limit. (The slots that the requests reuse put the passed request's key between the
    others', so that the hand-off's compare ranges around it both hold a key.)"""
    name = "pass"
    ready, behind, last = (permit_owner() for _ in range(3))
    open_backend = opener(single_url)
    async with open_backend() as here, open_backend() as there:
        # Slots <n> = 0 to 3 of `here`, given back in the order 3, 1, 2, 0: reused last
        # first, `mine` takes 0, `ready` 2, `behind` 1 and `last` 3.
        warm = [permit_owner() for _ in range(4)]
        asked = [await here.try_acquire_permit(name, w, LONG, "h", {}, 2, 1) for w in warm]
        for index in (3, 1, 2, 0):  # (2 and 3 were queued: they give up)
            token = asked[index].token if isinstance(asked[index], Grant) else None
            await here.release(name, warm[index], token)
        elsewhere = await there.try_acquire_permit(name, permit_owner(), LONG, "h", {}, 2, 1)
        mine = permit_owner()
        held = await here.try_acquire_permit(name, mine, LONG, "h", {}, 2, 1)
        assert isinstance(elsewhere, Grant) and isinstance(held, Grant)
        refusals: dict[str, HolderInfo] = {}
        for owner in (ready, behind, last):
            refused = await here.try_acquire_permit(name, owner, LONG, "w", {}, 2, 1)
            assert isinstance(refused, HolderInfo)
            refusals[owner] = refused
        found = await Gateway(single_url).keys(open_backend.prefix)  # type: ignore[attr-defined]
        keys = {json.loads(kv["value"])["owner"]: kv["key"] for kv in found}
        assert keys[behind] < keys[ready] < keys[last]
        with anyio.fail_after(WAIT):
            waits = anyio.create_task_group()  # the last request waits throughout
            await waits.__aenter__()
            waits.start_soon(here.wait_permit_turn, name, last, LONG, refusals[last])
            async with anyio.create_task_group() as tg:
                tg.start_soon(here.wait_permit_turn, name, ready, LONG, refusals[ready])
                await anyio.wait_all_tasks_blocked()
                permits = await there.read_permits(name)
                assert permits is not None and len(permits.holders) == 2
                holder = next(h for h in permits.holders if h.owner != mine)
                assert await there.release(name, holder.owner, elsewhere.token)
            # The first request's turn came by its watch; it has not asked yet.
            sent = _count_requests(here)
            async with anyio.create_task_group() as tg:
                tg.start_soon(here.wait_permit_turn, name, behind, LONG, refusals[behind])
                await anyio.wait_all_tasks_blocked()
                assert await here.release(name, mine, held.token)  # handed to `behind`
            assert sent == {"txn": 1}, sent
            second = await here.try_acquire_permit(name, behind, LONG, "w", {}, 2, 1)
            first = await here.try_acquire_permit(name, ready, LONG, "w", {}, 2, 1)
            assert isinstance(first, Grant) and isinstance(second, Grant)
            assert sent == {"txn": 2}, sent  # the first's grant: no read before it
            assert second.token < first.token  # (granted in that order)
            permits = await there.read_permits(name)
            assert permits is not None and permits.waiting == 1
            assert {h.owner for h in permits.holders} == {ready, behind}
            waits.cancel_scope.cancel()
            await waits.__aexit__(None, None, None)
            for owner, token in ((ready, first.token), (behind, second.token), (last, None)):
                await here.release(name, owner, token)
        assert await there.read_permits(name) is None


async def test_a_request_that_does_not_wait_is_handed_nothing(
    anyio_backend: str, single_url: str
) -> None:
    """A release hands its place only to a request that waits for its turn: one refused
    once (``acquire_nowait``'s) stays queued, as the model says, until it asks again or
    gives up. (Found by the model test: the writer's release made the queued reader a
    holder.)"""
    name, writer, reader = "nowait", permit_owner(), permit_owner()
    limit = 2**31 - 1
    async with opener(single_url)() as backend:
        held = await backend.try_acquire_permit(name, writer, LONG, "w", {}, limit, limit)
        assert isinstance(held, Grant)
        refused = await backend.try_acquire_permit(name, reader, LONG, "r", {}, limit, 1)
        assert isinstance(refused, HolderInfo)
        assert await backend.release(name, writer, held.token)
        permits = await backend.read_permits(name)
        assert permits is not None and (permits.holders, permits.waiting) == ((), 1)
        granted = await backend.try_acquire_permit(name, reader, LONG, "r", {}, limit, 1)
        assert isinstance(granted, Grant) and granted.token > held.token
        assert await backend.release(name, reader, granted.token)


async def _refuse(backend: Any, name: str, owners: list[str], limit: int) -> dict[str, HolderInfo]:
    """Queue ``owners`` on ``name`` (each refused once), in that order."""
    refusals = {}
    for owner in owners:
        refused = await backend.try_acquire_permit(name, owner, LONG, "w", {}, limit, 1)
        assert isinstance(refused, HolderInfo)
        refusals[owner] = refused
    return refusals


async def test_the_waiters_of_a_name_share_one_watch_stream(
    anyio_backend: str, single_url: str
) -> None:
    """Three requests wait for their turn on one backend while another backend holds
    every permit: their waits ride on one Watch stream (one watcher of the name on it),
    not a stream each (3 gRPC operations per wait, and every change sent to the process
    once per waiter); the release of the permits elsewhere wakes each of them. A request
    whose read predates events that the name's watcher delivered already (the releases
    it needs happened before it waits) is shown them: it returns at once, with no new
    stream either, and its next attempt takes its grant without a read."""
    name, limit = "shared", 4
    waiters = [permit_owner() for _ in range(3)]
    late = permit_owner()
    open_backend = opener(single_url)
    async with open_backend() as here, open_backend() as there:
        held = []
        for _ in range(limit):
            owner = permit_owner()
            grant = await there.try_acquire_permit(name, owner, LONG, "h", {}, limit, 1)
            assert isinstance(grant, Grant)
            held.append((owner, grant.token))
        refusals = await _refuse(here, name, [*waiters, late], limit)
        streams = inner(here).statistics().watch_streams  # (none: `here` holds nothing)
        woken: list[str] = []

        async def wait(owner: str) -> None:
            await here.wait_permit_turn(name, owner, LONG, refusals[owner])
            woken.append(owner)

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                for owner in waiters:
                    tg.start_soon(wait, owner)
                await anyio.wait_all_tasks_blocked()
                assert woken == []
                for owner, token in held:
                    assert await there.release(name, owner, token)
            assert sorted(woken) == sorted(waiters)
            # `late` read before every release: the watcher delivered them already.
            await wait(late)
        assert inner(here).statistics().watch_streams - streams == 1
        sent = _count_requests(here)
        grant = await here.try_acquire_permit(name, late, LONG, "w", {}, limit, 1)
        assert isinstance(grant, Grant) and sent == {"txn": 1}, sent
        assert await here.release(name, late, grant.token)
        for owner in waiters:
            await here.release(name, owner, None)  # gives up its queued request
        assert await there.read_permits(name) is None


async def test_a_broken_watch_stream_fails_the_waits_on_it(
    anyio_backend: str, tmp_path: Path
) -> None:
    """The server goes away while requests wait on the backend's shared permit watch:
    each wait raises BackendUnavailable (the core tries again), none hangs; once the
    server is back, a wait opens a new stream and the release elsewhere wakes it."""
    name = "broken"
    async with private_etcd(tmp_path / "etcd") as etcd:
        open_backend = opener(etcd.url)
        async with open_backend() as here, open_backend() as there:
            holder = permit_owner()
            held = await there.try_acquire_permit(name, holder, LONG, "h", {}, 1, 1)
            assert isinstance(held, Grant)
            owners = [permit_owner() for _ in range(3)]
            refusals = await _refuse(here, name, owners, 1)
            failed: list[str] = []

            async def wait(owner: str) -> None:
                with pytest.raises(BackendUnavailable):
                    await here.wait_permit_turn(name, owner, LONG, refusals[owner])
                failed.append(owner)

            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as tg:
                    for owner in owners:
                        tg.start_soon(wait, owner)
                    await anyio.wait_all_tasks_blocked()
                    await etcd.kill()
            assert sorted(failed) == sorted(owners)
            streams = inner(here).statistics().watch_streams
            await etcd.start()
            with anyio.fail_after(WAIT):
                while True:  # the channel reconnects (no event says when): ask again
                    try:
                        refusals = await _refuse(here, name, owners[:1], 1)
                        break
                    except BackendUnavailable:
                        await anyio.sleep(LOOK_AGAIN)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(here.wait_permit_turn, name, owners[0], LONG, refusals[owners[0]])
                    await anyio.wait_all_tasks_blocked()
                    assert await there.release(name, holder, held.token)
            assert inner(here).statistics().watch_streams == streams + 1
            for owner in owners:
                await here.release(name, owner, None)


async def test_a_request_queued_behind_a_waiter_here_is_one_txn(
    anyio_backend: str, single_url: str
) -> None:
    """While a request of the name waits on this backend, another request is queued
    behind it in one txn that also reads the keys (it was a read, then the txn): it is
    refused, counted behind the waiter, and its turn comes after the waiter's."""
    name = "behind"
    first, second = permit_owner(), permit_owner()
    open_backend = opener(single_url)
    async with open_backend() as here, open_backend() as there:
        holder = permit_owner()
        held = await there.try_acquire_permit(name, holder, LONG, "h", {}, 1, 1)
        assert isinstance(held, Grant)
        refusals = await _refuse(here, name, [first], 1)
        woken: list[str] = []
        turn = {owner: anyio.Event() for owner in (first, second)}

        async def wait(owner: str) -> None:
            await here.wait_permit_turn(name, owner, LONG, refusals[owner])
            woken.append(owner)
            turn[owner].set()

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait, first)
                await anyio.wait_all_tasks_blocked()
                sent = _count_requests(here)
                refusals.update(await _refuse(here, name, [second], 1))
                assert sent == {"txn": 1}, sent
                permits = await there.read_permits(name)
                assert permits is not None and permits.waiting == 2
                tg.start_soon(wait, second)
                await anyio.wait_all_tasks_blocked()
                assert await there.release(name, holder, held.token)
                await turn[first].wait()
                assert woken == [first]
                grant = await here.try_acquire_permit(name, first, LONG, "w", {}, 1, 1)
                assert isinstance(grant, Grant)
                assert await here.release(name, first, grant.token)
            assert woken == [first, second]
            grant = await here.try_acquire_permit(name, second, LONG, "w", {}, 1, 1)
            assert isinstance(grant, Grant)
            assert await here.release(name, second, grant.token)
        assert await there.read_permits(name) is None
