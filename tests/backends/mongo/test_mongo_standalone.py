"""A standalone mongod (``mongo-standalone`` of ``scripts/services.sh``, :27018): no
change streams (error 40573), so waiters sleep until the holder's ttl runs out; and a
server of the tests' own to kill and start again, with the tokens kept on disk."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import anyio
import pytest

import aiolease
from aiolease import AsyncLock, BackendError, Capability, Lease
from aiolease.abc import Backend, Grant
from aiolease.testing import CHECKS, Check
from tests.backends.mongo.conftest import DATABASE
from tests.backends.mongo.support import drop, inner, opener, unique_collection
from tests.backends.safety import ServiceRestart, restartable
from tests.support import unique, with_query

pytestmark = pytest.mark.anyio


@pytest.fixture
def standalone(aiolease_server: Callable[[str], str]) -> Iterator[str]:
    """The standalone server's URL, with a collection of the test's own."""
    url = aiolease_server("mongo-standalone")
    collection = unique_collection("standalone")
    yield with_query(url, collection=collection)
    drop(url, DATABASE, collection)


# One loop: the polling path runs inside the backend, on asyncio under both loops (the
# replica set's suite runs under both, and so do the other tests here).
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
async def test_conformance_without_change_streams(
    anyio_backend: str, standalone: str, check: Check
) -> None:
    await check(opener(standalone, poll_interval=0.05))


async def test_a_standalone_server_has_no_push_wakeups(anyio_backend: str, standalone: str) -> None:
    async with aiolease.open_backend(standalone) as backend:
        assert backend.capabilities == {
            Capability.SERVER_TIME,
            Capability.MULTI_PROCESS,
            Capability.PROCLAIM,
            Capability.SEMAPHORE,
            Capability.FAIR_PERMITS,
            Capability.PERMIT_RETRY_KEEPS_ENTRY,
            Capability.DURABLE_TOKENS,
            Capability.FAIR_QUEUE,
        }
        stats = inner(backend).statistics()
        assert (stats.topology, stats.streaming, stats.stream_opens) == ("standalone", False, 0)


async def test_a_waiter_takes_over_when_the_holders_ttl_runs_out(
    anyio_backend: str, standalone: str
) -> None:
    """No stream, and a poll interval longer than the test: the waiter wakes when the
    dead holder's ttl runs out, on its own timer."""
    name = unique("ttl")
    async with (
        aiolease.open_backend(standalone) as dead,
        aiolease.open_backend(standalone, poll_interval=600) as waiting,
    ):
        grant = await dead.try_acquire(name, "dead", 1.0, "dead", {})
        assert isinstance(grant, Grant)
        with anyio.fail_after(30):
            lease = await AsyncLock(waiting, name, ttl=10).acquire()
        assert lease.token == grant.token + 1
        assert await lease.release()


async def raise_token(backend: Backend, name: str, grants: int) -> int:
    token = 0
    for _ in range(grants):
        async with AsyncLock(backend, name, ttl=30) as lease:
            token = lease.token
    return token


async def test_tokens_survive_a_killed_server(
    anyio_backend: str, standalone: str, aiolease_server: Callable[[str], str]
) -> None:
    """The server is SIGKILLed while a lease is held and started again on its data: the
    grant and the token counter were majority-acknowledged (journaled), so the next
    grant's token is higher."""
    aiolease_server("mongo-standalone")
    control: ServiceRestart = restartable("mongo-standalone", "mongod.pid")
    name = unique("killed")
    async with aiolease.open_backend(standalone) as backend:
        before = await raise_token(backend, name, 3)
        held = await backend.try_acquire(name, "held", 2.0, "held", {})
        assert isinstance(held, Grant) and held.token == before + 1
        with anyio.CancelScope(shield=True):
            await control.kill()
            await control.start()
        lease: Lease | None = None
        with anyio.fail_after(60):
            while lease is None:
                try:
                    lease = await AsyncLock(backend, name, ttl=10).acquire()
                except BackendError:  # a pooled connection to the killed server
                    await anyio.sleep(0.1)
        assert lease.token == held.token + 1
        assert await lease.release()
    assert control.kills == 1
