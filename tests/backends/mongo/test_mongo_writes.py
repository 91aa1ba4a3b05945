"""The backend's writes as plain commands (``_writes.Writer``), against the real replica
set rs0: not retryable writes (the server then writes no session record per command),
with the backend's write concern; what our own second try after a failover rests on
(a grant asked again by its owner keeps its token, a release asked again frees
nothing); and which errors get that second try."""

from __future__ import annotations

from typing import Any

import pytest
from pymongo import monitoring
from pymongo.errors import (
    AutoReconnect,
    DuplicateKeyError,
    NetworkTimeout,
    NotPrimaryError,
    OperationFailure,
    ServerSelectionTimeoutError,
    WriteConcernError,
    WTimeoutError,
)

from aiolease.abc import Grant, HolderInfo
from aiolease.backends.mongo import MongoBackend
from aiolease.backends.mongo import _pipelines as pipelines
from aiolease.backends.mongo._writes import retryable
from tests.backends.mongo.test_mongo_backend import on_asyncio
from tests.support import unique

pytestmark = pytest.mark.anyio


class Sent(monitoring.CommandListener):
    """The lease commands a client sent."""

    def __init__(self) -> None:
        self.commands: list[dict[str, Any]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name in ("findAndModify", "update"):
            self.commands.append(dict(event.command))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


async def test_grants_and_releases_are_plain_commands_with_the_write_concern(
    anyio_backend: str, mongo: str, collection: str
) -> None:
    """Every grant, refusal and release (locks and permits) is sent without a
    transaction number (no retryable write) and with the backend's write concern."""
    sent = Sent()

    async def scenario() -> None:
        from pymongo import AsyncMongoClient

        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo, event_listeners=[sent])
        try:
            async with MongoBackend(client, collection=collection, wtimeout=5) as backend:
                name = unique("plain")
                grant = await backend.try_acquire(name, "o", 5, "me", {})
                assert isinstance(grant, Grant)
                assert isinstance(await backend.try_acquire(name, "p", 5, "them", {}), HolderInfo)
                assert await backend.release(name, "o", grant.token)  # handed to "p"
                assert await backend.release(name, "p", grant.token + 1)
                permit = await backend.try_acquire_permit(name, "permit:o", 5, "me", {}, 2, 1)
                assert isinstance(permit, Grant)
                assert await backend.release(name, "permit:o", permit.token)
        finally:
            await client.close()

    await on_asyncio(scenario)
    kinds = [next(iter(command)) for command in sent.commands]
    assert kinds.count("findAndModify") >= 3 and "update" in kinds
    for command in sent.commands:
        assert "txnNumber" not in command, command
        assert command["writeConcern"] == {"w": "majority", "wtimeout": 5000}, command


async def test_a_grant_sent_again_keeps_its_token_and_a_release_frees_once(
    anyio_backend: str, mongo: str, collection: str
) -> None:
    """What a second try after a failover rests on: the short grant sent again finds the
    name held (a duplicate key), and the full grant then renews the same owner's grant
    with the same token; a release sent again frees nothing."""

    async def scenario() -> tuple[int, int, bool, bool]:
        from pymongo import AsyncMongoClient

        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo)
        try:
            backend = MongoBackend(client, collection=collection)
            writer = backend._writer
            name = unique("again")
            first = await backend.try_acquire(name, "a", 5, "me", {})
            assert isinstance(first, Grant)
            assert await backend.release(name, "a", first.token)
            short = (pipelines.free_filter(name, True), pipelines.take_free("b", 5, "me", {}, "s"))
            taken = await writer.find_and_modify(
                *short, fields=pipelines.TAKEN, upsert=True, new=True
            )
            with pytest.raises(DuplicateKeyError):
                await writer.find_and_modify(*short, fields=pipelines.TAKEN, upsert=True, new=True)
            again = await backend.try_acquire(name, "b", 5, "me", {})
            assert isinstance(again, Grant)
            freed = await backend.release(name, "b", again.token)
            freed_twice = await backend.release(name, "b", again.token)
            await backend.aclose()
            return int(taken["token"]), again.token, freed, freed_twice
        finally:
            await client.close()

    taken, again, freed, freed_twice = await on_asyncio(scenario)
    assert taken == again == 2
    assert freed and not freed_twice


@pytest.mark.parametrize(
    ("error", "again"),
    [
        (NotPrimaryError("not primary"), True),
        (AutoReconnect("connection closed"), True),
        (OperationFailure("stepped down", 189), True),
        (OperationFailure("shutting down", 91), True),
        (WriteConcernError("stepped down while waiting", 189), True),
        (NetworkTimeout("timed out"), False),
        (ServerSelectionTimeoutError("no primary"), False),
        (WTimeoutError("waiting for replication timed out", 64), False),
        (OperationFailure("time limit", 50), False),
        (DuplicateKeyError("dup", 11000), False),
        (OperationFailure("bad pipeline", 40323), False),
        (ValueError("not pymongo's"), False),
    ],
)
def test_what_is_tried_again(error: BaseException, again: bool) -> None:
    """What pymongo's retryable writes would retry, except timeouts (unknown outcomes,
    settled by the core's compensating release) and a server that was never found."""
    assert retryable(error) is again
