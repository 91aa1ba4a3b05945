"""Permits (semaphores, read-write locks) on the replica set: what the conformance
suite cannot see from outside one backend object. Two backend objects stand for two
processes; the permits document is inspected with a client of the test's own."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from pymongo import AsyncMongoClient, monitoring

import aiolease
from aiolease import AsyncReadWriteLock, AsyncSemaphore, ForeignDataError, NotOwnerError
from aiolease.abc import Backend, Grant, HolderInfo, permit_owner
from aiolease.backends.mongo import MongoBackend
from aiolease.backends.mongo import _permit_acquire as permits_mod
from tests.backends.mongo.conftest import DATABASE
from tests.backends.mongo.support import inner, raw
from tests.support import eventually, unique, with_query

pytestmark = pytest.mark.anyio
LONG = 30.0


def permits_doc(url: str, collection: str, name: str) -> Any:
    with raw(url) as client:
        return client[DATABASE][f"{collection}_permits"].find_one({"_id": name})


async def test_two_backends_never_hold_more_than_the_limit(
    anyio_backend: str, mongo_url: str
) -> None:
    """Tasks on two backend objects share a limit of 2: never more inside at once, one
    token counter for the name, and nothing live afterwards."""
    name = unique("permits")
    inside, peak, tokens = 0, 0, []
    full = anyio.Event()
    async with (
        aiolease.open_backend(mongo_url) as first,
        aiolease.open_backend(mongo_url) as second,
    ):

        async def body(backend: Backend) -> None:
            nonlocal inside, peak
            async with AsyncSemaphore(backend, name, limit=2, ttl=LONG) as permit:
                tokens.append(permit.token)
                inside += 1
                peak = max(peak, inside)
                if inside == 2:
                    full.set()
                await full.wait()
                await anyio.lowlevel.checkpoint()
                inside -= 1

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for backend in (first, second, first, second):
                    tg.start_soon(body, backend)
        assert peak == 2
        assert sorted(tokens) == list(range(1, 5))  # one counter, every grant a new token
        assert await second.read_permits(name) is None


async def test_tokens_survive_the_release_of_every_permit(
    anyio_backend: str, mongo: str, mongo_url: str, collection: str
) -> None:
    """The last release keeps the name's document and its counter, so the next grant
    (a writer now) still takes a larger token; locks count apart."""
    name = unique("permits")
    async with aiolease.open_backend(mongo_url) as backend:
        rw = AsyncReadWriteLock(backend, name, ttl=LONG)
        async with rw.read() as reader:
            pass
        doc = permits_doc(mongo, collection, name)
        assert doc["token"] == reader.token == 1 and doc["entries"] == []
        async with rw.write() as writer:
            assert writer.token > reader.token
        lock = await backend.try_acquire(name, "lock-owner", LONG, "me", {})
        assert isinstance(lock, Grant) and lock.token == 1  # the lock's own counter


async def test_locks_and_permits_renew_in_one_call(anyio_backend: str, mongo_url: str) -> None:
    """One renew_many mixing locks and permits answers each for itself."""
    name = unique("permits")
    async with aiolease.open_backend(mongo_url) as backend:
        lock = await backend.try_acquire(name, "lock-owner", LONG, "me", {})
        owners = [permit_owner() for _ in range(2)]
        held = [await backend.try_acquire_permit(name, o, LONG, "me", {}, 3, 1) for o in owners]
        assert isinstance(lock, Grant) and all(isinstance(p, Grant) for p in held)
        renewals = [(name, "lock-owner", lock.token, LONG)]
        renewals += [(name, o, p.token, LONG) for o, p in zip(owners, held, strict=True)]
        renewals.insert(2, (name, permit_owner(), 99, LONG))  # nobody's
        before = inner(backend).statistics().renew_commands
        results = await backend.renew_many(renewals)
        assert [type(r) for r in results] == [Grant, Grant, NotOwnerError, Grant]
        # Counted: the permits' bulk_write and the locks' (each one command).
        assert inner(backend).statistics().renew_commands == before + 2


async def test_a_foreign_permits_document_is_refused_and_left(
    anyio_backend: str, mongo: str, mongo_url: str, collection: str
) -> None:
    name = unique("permits")
    with raw(mongo) as client:
        client[DATABASE][f"{collection}_permits"].insert_one({"_id": name, "token": "x"})
    async with aiolease.open_backend(mongo_url) as backend:
        with pytest.raises(ForeignDataError):
            await backend.try_acquire_permit(name, permit_owner(), LONG, "me", {}, 2, 1)
        with pytest.raises(ForeignDataError):
            await backend.read_permits(name)
    assert permits_doc(mongo, collection, name) == {"_id": name, "token": "x"}


class _Commands(monitoring.CommandListener):
    """The names of the commands sent on one collection."""

    def __init__(self, collection: str) -> None:
        self.collection = collection
        self.sent: list[str] = []
        #: The number of statements of each ``update`` command.
        self.updates: list[int] = []
        #: The query of each ``findAndModify`` command.
        self.queries: list[dict[str, Any]] = []
        #: The number of pipeline stages of each ``findAndModify`` command.
        self.stages: list[int] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command.get(event.command_name) == self.collection:
            self.sent.append(event.command_name)
            if event.command_name == "update":
                self.updates.append(len(event.command.get("updates", ())))
            if event.command_name == "findAndModify":
                self.queries.append(dict(event.command["query"]))
                update = event.command.get("update")
                self.stages.append(len(update) if isinstance(update, list) else 0)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@asynccontextmanager
async def counting_client(
    mongo: str, collection: str
) -> AsyncIterator[tuple[AsyncMongoClient[dict[str, Any]], _Commands]]:
    """A pymongo client of the test's own whose commands on ``collection``'s permits
    are recorded (closed at the end)."""
    commands = _Commands(f"{collection}_permits")
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo, event_listeners=[commands])
    try:
        yield client, commands
    finally:
        await client.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a pymongo client of the test's own
async def test_an_acquire_is_one_command(anyio_backend: str, mongo: str, collection: str) -> None:
    """Each acquire, granted, queued or refused without a write, is one ``findAndModify``
    (the decision is made on the server, atomically: no read first, no race to lose)."""
    async with counting_client(mongo, collection) as (client, commands):
        backend = MongoBackend(client, database=DATABASE, collection=collection)
        name, owners = unique("permits"), [permit_owner() for _ in range(3)]
        results = [await backend.try_acquire_permit(name, o, LONG, "me", {}, 2, 1) for o in owners]
        results.append(await backend.try_acquire_permit(name, owners[2], LONG, "me", {}, 2, 1))
        assert [type(r) for r in results] == [Grant, Grant, HolderInfo, HolderInfo]
        assert commands.sent == ["findAndModify"] * 4
        await backend.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a pymongo client of the test's own
async def test_the_operations_of_a_name_asked_meanwhile_go_in_one_command(
    anyio_backend: str, mongo: str, collection: str
) -> None:
    """Six acquires of a name asked at once, limit 3: the first goes alone, the five
    asked while it is in flight go together in the next ``findAndModify`` (one write
    of the document, in the order asked: nothing for the server to retry). The
    releases of the three queued, then of the three held, likewise: two commands each.
    The outcomes are those of one command each."""
    async with counting_client(mongo, collection) as (client, commands):
        backend = MongoBackend(client, database=DATABASE, collection=collection)
        name, owners = unique("permits"), [permit_owner() for _ in range(6)]
        results: dict[str, Grant | HolderInfo] = {}
        freed: dict[str, bool] = {}

        async def acquire(owner: str) -> None:
            results[owner] = await backend.try_acquire_permit(name, owner, LONG, "me", {}, 3, 1)

        async def release(owner: str) -> None:
            result = results[owner]
            token = result.token if isinstance(result, Grant) else None
            freed[owner] = await backend.release(name, owner, token)

        async with anyio.create_task_group() as tg:
            for owner in owners:
                tg.start_soon(acquire, owner)
        grants = [r for r in results.values() if isinstance(r, Grant)]
        assert len(grants) == 3
        assert sorted(grant.token for grant in grants) == [1, 2, 3]
        assert commands.sent == ["findAndModify"] * 2
        # The five asked meanwhile: one stage that folds them, parsed once (not a
        # stage of 5.6 kB per request).
        assert commands.stages == [1, 1]
        assert len(permits_doc(mongo, collection, name)["entries"]) == 6  # 3 held, 3 queued

        queued = [o for o in owners if isinstance(results[o], HolderInfo)]
        held = [o for o in owners if isinstance(results[o], Grant)]
        for group in (queued, held):  # a queued request released first is granted nothing
            async with anyio.create_task_group() as tg:
                for owner in group:
                    tg.start_soon(release, owner)
        assert freed == {o: o in held for o in owners}
        assert commands.sent == ["findAndModify"] * 6
        assert permits_doc(mongo, collection, name)["entries"] == []
        await backend.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a pymongo client of the test's own
async def test_the_releases_of_a_mixed_batch_go_first_in_one_command(
    anyio_backend: str, mongo: str, collection: str
) -> None:
    """Acquires and releases of a name asked meanwhile, interleaved, go in two commands
    (the releases, then the acquires), not one per change of kind; the releases first
    serve the queue first: the queued request is granted, then the first new one."""
    async with counting_client(mongo, collection) as (client, commands):
        backend = MongoBackend(client, database=DATABASE, collection=collection)
        name = unique("permits")
        h1, h2, q0, a1, a2 = (permit_owner() for _ in range(5))
        held = {
            o: await backend.try_acquire_permit(name, o, LONG, "me", {}, 2, 1) for o in (h1, h2)
        }
        tokens = {o: g.token for o, g in held.items() if isinstance(g, Grant)}
        assert sorted(tokens.values()) == [1, 2]
        sent = len(commands.sent)
        results: dict[str, object] = {}

        async def acquire(owner: str) -> None:
            results[owner] = await backend.try_acquire_permit(name, owner, LONG, "me", {}, 2, 1)

        async def release(owner: str) -> None:
            results[owner] = await backend.release(name, owner, tokens[owner])

        async with anyio.create_task_group() as tg:
            tg.start_soon(acquire, q0)  # alone, at once: the others wait for it
            for step, owner in ((acquire, a1), (release, h1), (acquire, a2), (release, h2)):
                tg.start_soon(step, owner)
        assert commands.sent[sent:] == ["findAndModify"] * 3
        assert results[h1] is True and results[h2] is True
        assert isinstance(results[q0], HolderInfo)  # queued; the releases granted it
        first_new = results[a1]
        assert isinstance(first_new, Grant) and first_new.token == 4
        assert isinstance(results[a2], HolderInfo)
        granted = {
            e["owner"]: e.get("token")
            for e in permits_doc(mongo, collection, name)["entries"]
            if e["granted"]
        }
        assert granted == {q0: 3, a1: 4}
        await backend.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a pymongo client of the test's own
async def test_a_release_grants_the_queued_request_it_fits_in_its_own_write(
    anyio_backend: str, mongo: str, collection: str
) -> None:
    """Limit 1, a holder and a queued request in one backend object: the holder's
    release grants the queued request (the next token) in the release's own write, and
    the request takes that grant without a command. Asked with another limit, it is
    not handed the grant: its command raises ``LimitMismatchError``."""
    async with counting_client(mongo, collection) as (client, commands):
        backend = MongoBackend(client, database=DATABASE, collection=collection)
        name, holder, waiter = unique("permits"), permit_owner(), permit_owner()
        held = await backend.try_acquire_permit(name, holder, LONG, "me", {}, 1, 1)
        assert isinstance(held, Grant)
        assert isinstance(
            await backend.try_acquire_permit(name, waiter, LONG, "", {}, 1, 1), HolderInfo
        )
        assert await backend.release(name, holder, held.token)
        entries = permits_doc(mongo, collection, name)["entries"]
        assert [(e["owner"], e["granted"], e["token"]) for e in entries] == [
            (waiter, True, held.token + 1)
        ]
        sent = len(commands.sent)
        granted = await backend.try_acquire_permit(name, waiter, LONG, "", {}, 1, 1)
        assert isinstance(granted, Grant)
        assert granted.token == held.token + 1
        assert 0 < granted.ttl <= LONG
        assert len(commands.sent) == sent  # taken from the release's reply
        # Another limit: no grant handed; the command refuses the request.
        other = permit_owner()
        assert isinstance(
            await backend.try_acquire_permit(name, other, LONG, "", {}, 1, 1), HolderInfo
        )
        assert await backend.release(name, waiter, granted.token)
        with pytest.raises(aiolease.LimitMismatchError):
            await backend.try_acquire_permit(name, other, LONG, "", {}, 2, 1)
        again = await backend.try_acquire_permit(name, other, LONG, "", {}, 1, 1)
        assert isinstance(again, Grant)
        assert again.token == granted.token + 1
        assert await backend.release(name, other, again.token)
        await backend.aclose()


def _short(query: dict[str, Any]) -> bool:
    """Whether a ``findAndModify`` query is the short acquire's (a free name's)."""
    return "entries" in query and "$expr" in query


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a pymongo client of the test's own
async def test_a_name_left_free_here_is_taken_with_the_short_command(
    anyio_backend: str, mongo: str, collection: str
) -> None:
    """After a release here that left the permits document without an entry, the next
    acquire is one short ``findAndModify`` (no upsert, a small pipeline), which writes
    what the full acquire would: the next token and arrival, and the permit as the only
    entry, read back by the full parser. A document that is not free any more (another
    backend object took a permit meanwhile) gets the full acquire after it, which
    decides as ever."""
    async with counting_client(mongo, collection) as (client, commands):
        async with (
            MongoBackend(client, database=DATABASE, collection=collection) as backend,
            aiolease.open_backend(with_query(mongo, collection=collection)) as other,
        ):
            name, owners = unique("permits"), [permit_owner() for _ in range(4)]
            first = await backend.try_acquire_permit(name, owners[0], LONG, "me", {}, 2, 1)
            assert isinstance(first, Grant) and await backend.release(name, owners[0], 1)
            commands.queries.clear()
            meta = {"k": "v"}
            second = await backend.try_acquire_permit(name, owners[1], LONG, "you", meta, 3, 2)
            assert isinstance(second, Grant) and second.token == 2
            assert [_short(q) for q in commands.queries] == [True]
            doc = permits_doc(mongo, collection, name)
            (entry,) = doc["entries"]
            assert (doc["token"], doc["seq"]) == (2, 2)
            assert {k: v for k, v in entry.items() if k != "expires"} == {
                "owner": owners[1],
                "weight": 2,
                "limit": 3,  # no live entry: this request sets the limit (rule 2)
                "granted": True,
                "seq": 2,
                "token": 2,
                "identity": "you",
                "metadata": {"k": "v"},
            }
            holders = await backend.read_permits(name)
            assert holders is not None and holders.limit == 3
            assert [(h.owner, h.token) for h in holders.holders] == [(owners[1], 2)]
            assert await backend.release(name, owners[1], 2)
            # Taken elsewhere meanwhile: the short command finds it held, the full decides.
            taken = await other.try_acquire_permit(name, owners[2], LONG, "", {}, 1, 1)
            assert isinstance(taken, Grant) and taken.token == 3
            commands.queries.clear()
            with pytest.raises(aiolease.LimitMismatchError):
                await backend.try_acquire_permit(name, owners[3], LONG, "", {}, 2, 1)
            assert [_short(q) for q in commands.queries] == [True, False]
            refused = await backend.try_acquire_permit(name, owners[3], LONG, "", {}, 1, 1)
            assert isinstance(refused, HolderInfo) and refused.owner == owners[2]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a pymongo client of the test's own
async def test_the_short_command_leaves_a_foreign_document_alone(
    anyio_backend: str, mongo: str, collection: str
) -> None:
    """A field aiolease does not write, added to a document a release here left free:
    the short command does not match it, and the full acquire refuses it
    (``ForeignDataError``); the document is left as it was."""
    async with counting_client(mongo, collection) as (client, commands):
        async with MongoBackend(client, database=DATABASE, collection=collection) as backend:
            name, owner = unique("permits"), permit_owner()
            granted = await backend.try_acquire_permit(name, owner, LONG, "", {}, 2, 1)
            assert isinstance(granted, Grant)
            assert await backend.release(name, owner, granted.token)
            with raw(mongo) as sync:
                permits = sync[DATABASE][f"{collection}_permits"]
                permits.update_one({"_id": name}, {"$set": {"x": 1}})
            before = permits_doc(mongo, collection, name)
            commands.queries.clear()
            with pytest.raises(ForeignDataError):
                await backend.try_acquire_permit(name, permit_owner(), LONG, "", {}, 2, 1)
            assert [_short(q) for q in commands.queries] == [True, False]
            assert permits_doc(mongo, collection, name) == before


async def test_a_held_permit_runs_no_takeover_watch(anyio_backend: str, mongo_url: str) -> None:
    """Nothing but its own renewals ends a permit before its expiry: the backend answers
    ``on_taken`` with a function for it, so the core starts no watch task per permit
    (it started one that waited for the backend to close)."""
    async with aiolease.open_backend(mongo_url) as backend:
        assert aiolease.Capability.PUSH_WAKEUP in backend.capabilities
        stop = backend.on_taken(unique("permits"), permit_owner(), 1, lambda reason: None)
        assert stop is not None
        stop()


async def test_concurrent_first_acquires_never_pass_the_limit(
    anyio_backend: str, mongo_url: str
) -> None:
    """Twenty first requests of a new name at once, from two backend objects: exactly
    the limit granted (racing first upserts included), each with its own token, and
    the others queued in the order the server saw them."""
    name = unique("permits")
    results: list[Grant | HolderInfo] = []
    async with (
        aiolease.open_backend(mongo_url) as first,
        aiolease.open_backend(mongo_url) as second,
    ):

        async def ask(backend: Backend) -> None:
            results.append(
                await backend.try_acquire_permit(name, permit_owner(), LONG, "", {}, 3, 1)
            )

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(ask, (first, second)[i % 2])
        tokens = sorted(r.token for r in results if isinstance(r, Grant))
        assert tokens == [1, 2, 3]
        permits = await first.read_permits(name)
        assert permits is not None and permits.used == 3 and permits.waiting == 17


async def test_a_release_elsewhere_wakes_a_waiter_through_the_stream(
    anyio_backend: str, mongo_url: str
) -> None:
    """A waiter of one backend object is woken by a release through another one (the
    permits' change stream): within 5 s, where without the push it would wait 10 s
    (its ttl's third and the push safety net; its poll interval is 30 s)."""
    name, holder, waiter = unique("permits"), permit_owner(), permit_owner()
    async with (
        aiolease.open_backend(mongo_url, poll_interval=30) as first,
        aiolease.open_backend(mongo_url, poll_interval=30) as second,
    ):
        held = await first.try_acquire_permit(name, holder, 60, "", {}, 1, 1)
        assert isinstance(held, Grant)
        seen = await second.try_acquire_permit(name, waiter, 60, "", {}, 1, 1)
        assert isinstance(seen, HolderInfo)
        # The first wait opens the stream, and returns at once (a release may have come
        # before it opened): the next refusal is then seen with the stream up.
        with anyio.fail_after(5):
            await second.wait_permit_turn(name, waiter, 60, seen)
        seen = await second.try_acquire_permit(name, waiter, 60, "", {}, 1, 1)
        assert isinstance(seen, HolderInfo)
        done = anyio.Event()

        async def wait() -> None:
            await second.wait_permit_turn(name, waiter, 60, seen)
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await eventually(lambda: inner(second).statistics().waiting >= 1, "a blocked wait")
            assert await first.release(name, holder, held.token)
            with anyio.fail_after(5):
                await done.wait()
        assert isinstance(await second.try_acquire_permit(name, waiter, 60, "", {}, 1, 1), Grant)


async def test_a_release_here_wakes_only_the_waiters_it_fits(
    anyio_backend: str, mongo_url: str
) -> None:
    """Limit 1, two waiters queued in one backend object: the holder's release wakes
    the first (whom the document now grants), not the second, which would only be
    refused again; the first's release then wakes the second."""
    name, holder = unique("permits"), permit_owner()
    first, second = permit_owner(), permit_owner()
    async with aiolease.open_backend(mongo_url, poll_interval=30) as backend:
        held = await backend.try_acquire_permit(name, holder, 60, "", {}, 1, 1)
        assert isinstance(held, Grant)
        # A first wait opens the stream and returns at once (see the test above).
        seen = await backend.try_acquire_permit(name, first, 60, "", {}, 1, 1)
        assert isinstance(seen, HolderInfo)
        with anyio.fail_after(5):
            await backend.wait_permit_turn(name, first, 60, seen)
        refused: dict[str, HolderInfo] = {}
        for owner in (first, second):
            blocked = await backend.try_acquire_permit(name, owner, 60, "", {}, 1, 1)
            assert isinstance(blocked, HolderInfo)
            refused[owner] = blocked
        woken: dict[str, anyio.Event] = {first: anyio.Event(), second: anyio.Event()}

        async def wait(owner: str) -> None:
            await backend.wait_permit_turn(name, owner, 60, refused[owner])
            woken[owner].set()

        async with anyio.create_task_group() as tg:
            for owner in (first, second):
                tg.start_soon(wait, owner)
            await eventually(lambda: inner(backend).statistics().waiting >= 2, "two waits")
            assert await backend.release(name, holder, held.token)
            with anyio.fail_after(5):
                await woken[first].wait()
            granted = await backend.try_acquire_permit(name, first, 60, "", {}, 1, 1)
            assert isinstance(granted, Grant)
            assert not woken[second].is_set()  # a round trip later: still asleep
            assert await backend.release(name, first, granted.token)
            with anyio.fail_after(5):
                await woken[second].wait()
        last = await backend.try_acquire_permit(name, second, 60, "", {}, 1, 1)
        assert isinstance(last, Grant)
        assert await backend.release(name, second, last.token)


async def test_a_renewal_matches_each_permit_by_its_token_and_its_owner(
    anyio_backend: str, mongo_url: str
) -> None:
    """Renewals find a permit by its token, then check the owner at that place: a
    token asked with another permit's owner renews neither, in a call of several
    permits (one update for the name, then one per permit) as alone."""
    name = unique("permits")
    async with aiolease.open_backend(mongo_url) as backend:
        owners = [permit_owner() for _ in range(3)]
        held = [await backend.try_acquire_permit(name, o, LONG, "me", {}, 3, 1) for o in owners]
        assert all(isinstance(g, Grant) for g in held)
        tokens = [g.token for g in held if isinstance(g, Grant)]
        crossed = [(name, owners[0], tokens[1], LONG), (name, owners[2], tokens[2], LONG)]
        results = await backend.renew_many(crossed)
        assert [type(r) for r in results] == [NotOwnerError, Grant]
        assert [type(r) for r in await backend.renew_many(crossed[:1])] == [NotOwnerError]
        exact = [(name, o, t, LONG) for o, t in zip(owners, tokens, strict=True)]
        assert all(isinstance(r, Grant) for r in await backend.renew_many(exact))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a pymongo client of the test's own
async def test_the_permits_of_a_name_renew_in_one_statement(
    anyio_backend: str, mongo: str, collection: str
) -> None:
    """Twenty live permits of one name renew in one update statement (one write of the
    document, not twenty); with one of them released, the others still renew, and the
    released one is not revived."""
    async with counting_client(mongo, collection) as (client, commands):
        backend = MongoBackend(client, database=DATABASE, collection=collection)
        name, owners = unique("permits"), [permit_owner() for _ in range(20)]
        held = [await backend.try_acquire_permit(name, o, LONG, "me", {}, 20, 1) for o in owners]
        assert all(isinstance(g, Grant) for g in held)
        renewals = [(name, o, g.token, LONG) for o, g in zip(owners, held, strict=True)]
        commands.updates.clear()
        results = await backend.renew_many(renewals)
        assert all(isinstance(r, Grant) for r in results)
        assert commands.updates == [1]
        assert await backend.release(name, owners[3], held[3].token)
        results = await backend.renew_many(renewals)
        assert [i for i, r in enumerate(results) if isinstance(r, NotOwnerError)] == [3]
        assert all(isinstance(r, Grant) for i, r in enumerate(results) if i != 3)
        holders = await backend.read_permits(name)
        assert holders is not None
        assert {h.owner for h in holders.holders} == set(owners) - {owners[3]}
        await backend.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a pymongo client of the test's own
async def test_a_held_permit_sends_nothing_between_renewals(
    anyio_backend: str, mongo: str, collection: str
) -> None:
    """While a permit is held in ``async with`` (its renewal far off), the backend sends
    nothing on the permits collection: there is no takeover watch (one read the permits
    document again and again: the lock document it compared was never the permit's)."""
    async with counting_client(mongo, collection) as (client, commands):
        async with MongoBackend(client, database=DATABASE, collection=collection) as backend:
            await backend.probe()  # the change stream: PUSH_WAKEUP, so the watch runs
            sem = AsyncSemaphore(backend, unique("permits"), limit=2, ttl=LONG)
            async with sem:
                commands.sent.clear()
                for _ in range(5):  # five round trips of ours, time for a watch's reads
                    assert await backend.read_permits(sem.name) is not None
                assert commands.sent == ["find"] * 5


def test_the_folded_acquires_decide_as_the_acquires_one_after_the_other(
    mongo: str, collection: str
) -> None:
    """``acquire_many`` (one stage folding the requests) leaves the document that the
    requests' ``acquire`` stages leave one after the other, whatever each decides: a
    holder's renewal, a fresh queue entry kept as it is, a stale one refreshed, a limit
    mismatch (nothing), a new request queued (its identity and metadata with ``$`` in
    them kept as text), and, once a place is free, a grant. Expiries are compared apart
    (each command reads its own ``$$NOW``)."""
    held, other, fresh, stale = (permit_owner() for _ in range(4))
    new = [permit_owner() for _ in range(3)]
    minute = 60_000
    setup: list[permits_mod.Request] = [
        (o, minute, o[-4:], {}, 2, 1, minute // 2) for o in (held, other, fresh, stale)
    ]
    requests: list[permits_mod.Request] = [
        (held, minute, "h", {}, 2, 1, minute // 2),  # the holder's retry: renewed
        (fresh, 2 * minute, "f", {}, 2, 1, minute // 2),  # fresh: kept as it is
        (stale, 2 * minute, "s", {}, 2, 1, 3 * minute),  # stale: its expiry reset
        (new[0], minute, "n", {}, 3, 1, minute // 2),  # another limit: nothing
        (new[1], minute, "$id", {"$k": "$v"}, 2, 1, minute // 2),  # queued
    ]
    # Once `other` is gone: the first in the queue is granted, a new one queued.
    freed: list[permits_mod.Request] = [
        (fresh, minute, "f", {}, 2, 1, minute // 2),
        (new[2], minute, "g", {}, 2, 1, 1),
    ]

    with raw(mongo) as client:
        coll = client[DATABASE][f"{collection}_permits"]
        after: list[Any] = []
        for fold in (False, True):
            name = unique("fold")
            for request in setup:
                coll.find_one_and_update({"_id": name}, permits_mod.acquire(*request), upsert=True)
            for batch in (requests, freed):
                stages = (
                    permits_mod.acquire_many(batch)
                    if fold
                    else [stage for r in batch for stage in permits_mod.acquire(*r)]
                )
                coll.find_one_and_update({"_id": name}, stages, upsert=True)
                coll.update_one({"_id": name}, {"$pull": {"entries": {"owner": other}}})
            after.append(coll.find_one({"_id": name}))
    expires = [{e["owner"]: e.pop("expires") for e in doc["entries"]} for doc in after]
    assert {**after[0], "_id": None} == {**after[1], "_id": None}
    entries = [(e["owner"], e["granted"], e["token"], e["seq"]) for e in after[1]["entries"]]
    assert entries == [  # in arrival order (seq), a grant's entry moved to the end
        (held, True, 1, 1),
        (stale, False, 0, 4),
        (new[1], False, 0, 5),
        (fresh, True, 3, 3),
        (new[2], False, 0, 6),
    ]
    queued = after[1]["entries"][2]
    assert (queued["identity"], queued["metadata"]) == ("$id", {"$k": "$v"})
    for seen in expires:  # stale's reset to two minutes on; fresh's a minute from its grant
        assert (seen[stale] - seen[fresh]).total_seconds() > 50
