"""Permits (semaphores, read-write locks) on the replica set: what the conformance
suite cannot see from outside one backend object. Two backend objects stand for two
processes; the permits document is inspected with a client of the test's own."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import aiolease
from aiolease import AsyncReadWriteLock, AsyncSemaphore, ForeignDataError, NotOwnerError
from aiolease.abc import Backend, Grant, permit_owner
from tests.backends.mongo.conftest import DATABASE
from tests.backends.mongo.support import inner, raw
from tests.support import unique

pytestmark = pytest.mark.anyio
LONG = 30.0


def on(*backends: Backend) -> None:
    """Turn on the permits, implemented but not declared yet (see the internals)."""
    for backend in backends:
        inner(backend)._permits = True


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
        on(first, second)

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
        on(backend)
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
        on(backend)
        lock = await backend.try_acquire(name, "lock-owner", LONG, "me", {})
        owners = [permit_owner() for _ in range(2)]
        held = [await backend.try_acquire_permit(name, o, LONG, "me", {}, 3, 1) for o in owners]
        assert isinstance(lock, Grant) and all(isinstance(p, Grant) for p in held)
        renewals = [(name, "lock-owner", lock.token, LONG)]
        renewals += [(name, o, p.token, LONG) for o, p in zip(owners, held, strict=True)]
        renewals.insert(2, (name, permit_owner(), 99, LONG))  # nobody's
        results = await backend.renew_many(renewals)
        assert [type(r) for r in results] == [Grant, Grant, NotOwnerError, Grant]


async def test_a_foreign_permits_document_is_refused_and_left(
    anyio_backend: str, mongo: str, mongo_url: str, collection: str
) -> None:
    name = unique("permits")
    with raw(mongo) as client:
        client[DATABASE][f"{collection}_permits"].insert_one({"_id": name, "token": "x"})
    async with aiolease.open_backend(mongo_url) as backend:
        on(backend)
        with pytest.raises(ForeignDataError):
            await backend.try_acquire_permit(name, permit_owner(), LONG, "me", {}, 2, 1)
        with pytest.raises(ForeignDataError):
            await backend.read_permits(name)
    assert permits_doc(mongo, collection, name) == {"_id": name, "token": "x"}
