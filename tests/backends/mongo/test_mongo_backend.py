"""What the MongoDB backend promises beyond the conformance checks, against the real
replica set rs0, under asyncio and trio: capabilities, the user's client, durable
tokens kept in the document, the server's clock only, racing first upserts, renewals
in one ``bulk_write``, one change stream per backend, and URL options."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from datetime import timedelta
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import pytest

import aiolease
from aiolease import AsyncLock, BackendError, Capability, InvalidArgument, NotOwnerError
from aiolease._bridge import call_asyncio, running_trio
from aiolease._records import state_of
from aiolease.abc import Backend, Grant, HolderInfo
from aiolease.backends.mongo import MongoBackend
from aiolease.backends.mongo._url import parse_url
from tests.backends.mongo.conftest import DATABASE
from tests.backends.mongo.support import inner, raw
from tests.support import unique, with_query

pytestmark = pytest.mark.anyio

T = TypeVar("T")


async def on_asyncio(fn: Callable[[], Awaitable[T]]) -> T:
    """Run ``fn`` on asyncio: itself under asyncio, on a trio-asyncio loop under trio."""
    if not running_trio():
        return await fn()
    import trio_asyncio

    async with AsyncExitStack() as stack:
        if trio_asyncio.current_loop.get() is None:
            await stack.enter_async_context(trio_asyncio.open_loop())
        return await call_asyncio(fn)


def look(url: str, collection: str, name: str) -> dict[str, Any] | None:
    """Document ``name`` as stored, with the server's clock (``now``) beside it."""
    with raw(url) as client:
        found = list(
            client[DATABASE][collection].aggregate(
                [{"$match": {"_id": name}}, {"$set": {"now": "$$NOW"}}]
            )
        )
    return found[0] if found else None


async def test_capabilities_per_instance(anyio_backend: str, mongo_url: str) -> None:
    common = {
        Capability.SERVER_TIME,
        Capability.MULTI_PROCESS,
        Capability.PROCLAIM,
        Capability.SEMAPHORE,
        Capability.FAIR_PERMITS,
        Capability.PERMIT_RETRY_KEEPS_ENTRY,
    }
    async with (
        aiolease.open_backend(mongo_url) as fair,
        aiolease.open_backend(mongo_url, fair=False) as plain,
        aiolease.open_backend(mongo_url, watch=False, w=1) as quiet,
    ):
        assert fair.capabilities == common | {
            Capability.DURABLE_TOKENS,
            Capability.FAIR_QUEUE,
            Capability.PUSH_WAKEUP,
        }
        assert plain.capabilities == common | {Capability.DURABLE_TOKENS, Capability.PUSH_WAKEUP}
        # w=1 may lose a grant in a failover: its token could be handed out again.
        assert quiet.capabilities == common | {Capability.FAIR_QUEUE}
        assert inner(fair).statistics().topology == "replica set"


async def test_tokens_survive_release_in_the_kept_document(
    anyio_backend: str, mongo: str, mongo_url: str, collection: str
) -> None:
    name = unique("tokens")
    tokens = []
    async with aiolease.open_backend(mongo_url) as backend:
        for owner in ("a", "b", "c"):
            grant = await backend.try_acquire(name, owner, 30, owner, {"k": owner})
            assert isinstance(grant, Grant)
            tokens.append(grant.token)
            assert await backend.release(name, owner, grant.token)
            doc = await anyio.to_thread.run_sync(look, mongo, collection, name)
            assert doc is not None and "owner" not in doc and doc["token"] == grant.token
            assert await backend.read(name) is None
    assert tokens == [1, 2, 3]


async def test_expiry_is_the_servers_clock_whatever_the_clients(
    anyio_backend: str, mongo: str, mongo_url: str, collection: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client whose wall clock is 7 minutes ahead: the document's expiry is the server's
    now + ttl, and the holder read back has the full ttl left."""
    skewed = time.time() + 420
    monkeypatch.setattr(time, "time", lambda: skewed)
    name = unique("skew")
    async with aiolease.open_backend(mongo_url) as backend:
        grant = await backend.try_acquire(name, "o", 20, "me", {})
        assert isinstance(grant, Grant)
        holder = await backend.read(name)
    doc = await anyio.to_thread.run_sync(look, mongo, collection, name)
    assert doc is not None and holder is not None
    assert doc["expires"] - doc["acquired"] == timedelta(seconds=20)
    # Granted within the last minute of the server's clock, not 7 minutes from now.
    assert timedelta(0) <= doc["now"] - doc["acquired"] < timedelta(minutes=1)
    assert holder.remaining is not None and 0 < holder.remaining <= 20


async def test_racing_first_upserts_grant_once(anyio_backend: str, mongo_url: str) -> None:
    """Many backends ask for a name nobody ever held, at once: one grant, every other
    caller is told who holds it (a duplicate key is never an error)."""
    name = unique("race")
    outcomes: list[Grant | HolderInfo] = []

    async def ask(i: int) -> None:
        async with aiolease.open_backend(mongo_url, fair=False) as backend:
            outcomes.append(await backend.try_acquire(name, f"owner-{i}", 30, f"id-{i}", {}))

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(ask, i)
    grants = [o for o in outcomes if isinstance(o, Grant)]
    assert [g.token for g in grants] == [1]
    holders = {(o.owner, o.token) for o in outcomes if isinstance(o, HolderInfo)}
    assert len(holders) <= 1 and len(outcomes) == 8


async def test_a_name_seen_released_is_taken_with_the_short_command(
    anyio_backend: str, mongo_url: str
) -> None:
    """After its own release a backend takes the name again with the short command (one
    command); if the name was taken elsewhere meanwhile (unseen: no change stream), the
    short command finds it held and the full one reports the holder; tokens go on."""
    name = unique("again")
    async with (
        aiolease.open_backend(mongo_url, watch=False) as here,
        aiolease.open_backend(mongo_url) as there,
    ):
        tokens = []
        for owner in ("a", "b"):
            grant = await here.try_acquire(name, owner, 30, "here", {})
            assert isinstance(grant, Grant)
            tokens.append(grant.token)
            assert await here.release(name, owner, grant.token)
        taken = await there.try_acquire(name, "c", 30, "there", {})
        assert isinstance(taken, Grant)
        before = inner(here).statistics().acquire_commands
        refused = await here.try_acquire(name, "d", 30, "here", {})
        assert isinstance(refused, HolderInfo)
        assert (refused.owner, refused.token) == ("c", taken.token)
        assert inner(here).statistics().acquire_commands == before + 2  # short, then full
        assert await there.release(name, "c", taken.token)
        again = await here.try_acquire(name, "d", 30, "here", {})
        assert isinstance(again, Grant)
        assert tokens + [taken.token, again.token] == [1, 2, 3, 4]


async def test_renew_many_is_one_bulk_write(anyio_backend: str, mongo_url: str) -> None:
    async with aiolease.open_backend(mongo_url) as backend:
        mongo_backend = inner(backend)
        names = [unique("many") for _ in range(50)]
        granted = {}
        for name in names:
            grant = await backend.try_acquire(name, "o", 30, "me", {})
            assert isinstance(grant, Grant)
            granted[name] = grant.token
        assert await backend.release(names[7], "o", granted[names[7]])
        before = mongo_backend.statistics().renew_commands
        results = await backend.renew_many([(n, "o", granted[n], 30.0) for n in names])
        assert mongo_backend.statistics().renew_commands == before + 1
        assert isinstance(results[7], NotOwnerError)
        assert all(isinstance(r, Grant) for i, r in enumerate(results) if i != 7)
        for name in names:
            await backend.release(name, "o", granted[name])


async def wait_until_released(backend: Backend, name: str, holder: HolderInfo) -> None:
    """``wait_changed`` until a read shows ``holder`` gone."""
    while state_of(await backend.read(name)) == state_of(holder):
        await backend.wait_changed(name, holder)


async def test_one_change_stream_wakes_every_waiter(anyio_backend: str, mongo_url: str) -> None:
    """Waiters of many names in one backend share one stream; a release elsewhere
    wakes the waiter of its name (long ttl, and no polling: only the event can).

    ``wait_changed`` may return early (the contract lets it, and callers re-read): the
    stream opened with the backend, so the holder's own grant events can reach it late,
    after a waiter has read. Each waiter here waits again until its read shows the
    release, as the core does."""
    names = [unique("woken") for _ in range(5)]
    async with (
        aiolease.open_backend(mongo_url, poll_interval=600) as waiting,
        aiolease.open_backend(mongo_url) as holding,
    ):
        seen = []
        for name in names:
            grant = await holding.try_acquire(name, "h", 600, "holder", {})
            assert isinstance(grant, Grant)
            holder = await waiting.read(name)
            assert holder is not None
            seen.append((name, holder))
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for name, holder in seen:
                    tg.start_soon(wait_until_released, waiting, name, holder)
                while inner(waiting).statistics().waiting < len(names):  # noqa: ASYNC110
                    await anyio.sleep(0.01)
                for name, holder in seen:
                    assert await holding.release(name, "h", holder.token)
        assert inner(waiting).statistics().stream_opens == 1


async def test_a_users_client_is_used_and_never_closed(
    anyio_backend: str, mongo: str, collection: str
) -> None:
    async def scenario() -> tuple[int, int]:
        from pymongo import AsyncMongoClient

        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo)
        try:
            backend = MongoBackend(client, collection=collection)
            assert Capability.PUSH_WAKEUP not in backend.capabilities  # not probed yet
            assert await backend.probe() == "replica set"
            async with backend:
                grant = await backend.try_acquire("n", "o", 5, "me", {})
                assert isinstance(grant, Grant)
            still = await client.get_database(DATABASE)[collection].count_documents({})
            return grant.token, still
        finally:
            await client.close()

    token, documents = await on_asyncio(scenario)
    assert token == 1 and documents == 1  # closing released it and kept the document


MOTOR_SCENARIO = """
import asyncio, sys
from motor.motor_asyncio import AsyncIOMotorClient
from aiolease.abc import Grant, HolderInfo
from aiolease.backends.mongo import MongoBackend

async def main(url, collection):
    client = AsyncIOMotorClient(url)
    async with MongoBackend(client, collection=collection) as backend:
        assert await backend.probe() == "replica set"
        grant = await backend.try_acquire("m", "o", 5, "me", {})
        assert isinstance(grant, Grant), grant
        other = await backend.try_acquire("m", "p", 5, "them", {})
        assert isinstance(other, HolderInfo) and other.owner == "o", other
        assert (await backend.renew("m", "o", grant.token, 5)).token == grant.token
        assert await backend.release("m", "o", grant.token)
        again = await backend.try_acquire("m", "p", 5, "them", {})
        assert isinstance(again, Grant) and again.token == 2, again
        assert await backend.release("m", "p", again.token)
    assert await client.get_database("aiolease")[collection].count_documents({}) == 1
    client.close()
    print("motor ok")

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_a_motor_client_is_accepted(mongo: str, collection: str) -> None:
    """On asyncio (motor runs its driver in threads, which trio-asyncio's loop refuses:
    under trio, give the backend a pymongo client). A process of its own: the suite's
    asyncio loops are trio-asyncio's."""
    done = subprocess.run(
        [sys.executable, "-c", MOTOR_SCENARIO, mongo, collection],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "motor ok"


def test_anything_else_is_not_a_client() -> None:
    with pytest.raises(InvalidArgument, match="AsyncMongoClient"):
        MongoBackend(object())


@pytest.mark.parametrize(
    ("url", "options", "match"),
    [
        ("redis://127.0.0.1", {}, "mongodb://"),
        ("mongodb:///db", {}, "no host"),
        ("mongodb://h/db?collection=system.users", {}, "malformed"),
        ("mongodb://h/db", {"collection": "a$b"}, "collection"),
        ("mongodb://h/db", {"collection": "x" * 200}, "collection"),
        ("mongodb://h/db", {"database": "a.b"}, "database"),
        ("mongodb://h/we$ird", {}, "database"),
        ("mongodb://h/db?fair=1", {"fair": True}, "given in the URL and as arguments"),
        ("mongodb://h/db", {"nosuch": 1}, "unknown MongoDB option"),
        ("mongodb://h/db?w=-1", {}, "malformed"),
        ("mongodb://h/db?wtimeoutMS=5", {}, "not taken"),
        ("mongodb://h/db?readPreference=secondary", {}, "not taken"),
        ("mongodb://h/db?W=1", {}, "write it as 'w'"),
    ],
)
def test_bad_urls_are_invalid(url: str, options: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        parse_url(url, options)


def test_the_database_comes_from_the_option_the_path_or_the_default() -> None:
    assert parse_url("mongodb://h/app", {}).database == "app"
    assert parse_url("mongodb://h/app?database=other", {}).database == "other"
    assert parse_url("mongodb://h", {}).database == "aiolease"
    parsed = parse_url("mongodb+srv://u:p@cluster.example/app?retryWrites=false&fair=0", {})
    assert parsed.options == {"fair": False}
    assert "retryWrites=false" in parsed.client_url


async def test_an_unsatisfiable_write_concern_is_never_a_grant(
    anyio_backend: str, mongo_url: str
) -> None:
    """A grant whose write concern fails (two members asked of a set of one) is an
    unknown outcome: an error, never a lease."""
    name = unique("w2")
    async with aiolease.open_backend(mongo_url, w=2, wtimeout=0.5) as backend:
        with pytest.raises(BackendError):
            await backend.try_acquire(name, "o", 5, "me", {})
        with pytest.raises(BackendError):
            await AsyncLock(backend, name, ttl=5).acquire_nowait()


UNREACHABLE_SCENARIO = """
import asyncio
import aiolease

async def main():
    try:
        async with aiolease.open_backend(
            "mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=300&directConnection=true"
        ):
            pass
    except aiolease.BackendUnavailable as exc:
        print("unavailable:", exc)

asyncio.run(main())
"""


def test_an_unreachable_server_is_unavailable() -> None:
    """In a process of its own: pymongo 4.20's asyncio client drops the socket of a
    refused connect without closing it, a ResourceWarning that would land in whichever
    test the garbage collector runs in."""
    done = subprocess.run(
        [sys.executable, "-c", UNREACHABLE_SCENARIO],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("unavailable: ") and "127.0.0.1:1" in done.stdout


async def test_a_hostile_collection_name_is_invalid(anyio_backend: str, mongo: str) -> None:
    for bad in ("$cmd", "system.js", "a\x00b", "", "x" * 121):
        with pytest.raises(InvalidArgument, match="collection"):
            async with aiolease.open_backend(with_query(mongo, collection=bad)):
                pass  # pragma: no cover


def test_expiry_arithmetic_never_grants_less_than_asked() -> None:
    from aiolease.backends.mongo._pipelines import millis

    assert millis(0.0001) == 1 and millis(1.0) == 1000 and millis(2.0005) == 2001
