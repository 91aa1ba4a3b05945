"""The PostgreSQL backend through PgBouncer in transaction mode (the ``pgbouncer`` service).

Behind a transaction pooler, each transaction (an autocommitted statement is one) may
run on a different server session, so nothing may rely on session state: not asyncpg's
named prepared statements, and not ``LISTEN``, which PgBouncer accepts and then lets
the session it ran on go back to the pool, where notifications reach nobody.
``pooler=transaction`` turns both off; ``listen_url`` gives the listener a direct
connection while every lease statement still goes through the pooler.

Every test uses tables in a schema of this run (dropped at the end).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest

import aiolease
from aiolease import AsyncLock, Capability, InvalidArgument
from aiolease.abc import Backend, Grant, HolderInfo
from aiolease.backends.postgres import PostgresBackend
from aiolease.testing import CHECKS, Check
from tests.backends.postgres.support import changed, raw, waiting
from tests.support import grant, inner, raises, refused, unique, with_query

pytestmark = pytest.mark.anyio

#: How each backend of a test waits: by polling (nothing listens through the pooler),
#: or woken by NOTIFY on a listener connected to the server directly.
MODES = ["poll", "listen_url"]


# -- fixtures and helpers ------------------------------------------------------------------


def mode_url(pooled: str, pg: str, mode: str, **options: object) -> str:
    """``pooled``, with a direct listener for ``listen_url`` mode."""
    if mode == "listen_url":
        options["listen_url"] = pg
    return with_query(pooled, **options)


@asynccontextmanager
async def backend(url: str, **options: Any) -> AsyncIterator[Backend]:
    async with aiolease.open_backend(url, **options) as b:
        yield b


# -- the service ---------------------------------------------------------------------------


async def test_the_service_is_pgbouncer_in_transaction_mode(bouncer: str) -> None:
    # Everything below proves something only behind a transaction pooler. PgBouncer's
    # admin console speaks only the simple query protocol, hence psql.
    parts = urlsplit(bouncer)
    result = await anyio.run_process(
        [
            "psql", "-X", "-w", "-tA", "-h", parts.hostname or "127.0.0.1",
            "-p", str(parts.port or 6432), "-U", parts.username or "postgres",
            "-d", "pgbouncer", "-c", "SHOW CONFIG",
        ],
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()
    settings = {
        line.split("|")[0]: line.split("|")[1] for line in result.stdout.decode().splitlines()
    }
    assert settings["pool_mode"] == "transaction"


# -- the contract --------------------------------------------------------------------------


# Once per loop, each loop with one of the two modes (docs/testing.md, "Keeping the
# suite short"): every check meets both loops and both modes.
@pytest.mark.parametrize(("anyio_backend", "mode"), [("asyncio", "poll"), ("trio", "listen_url")])
@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
async def test_conformance(
    anyio_backend: str, check: Check, pooled: str, pg: str, mode: str
) -> None:
    url = mode_url(pooled, pg, mode, table=unique("conformance"))
    await check(lambda: aiolease.open_backend(url))


async def test_pooler_transaction_listens_only_through_a_listen_url(
    pooled: str, pg: str, bouncer: str
) -> None:
    listening = mode_url(pooled, pg, "listen_url")
    async with backend(pooled) as polling, backend(listening) as pushed:
        assert Capability.PUSH_WAKEUP not in polling.capabilities
        assert Capability.PUSH_WAKEUP in pushed.capabilities
    with raises(InvalidArgument, match="listen_url"):
        async with backend(pooled, listen=True):
            pass
    with raises(InvalidArgument, match="pooler"):
        async with backend(with_query(bouncer, pooler="statement")):
            pass


async def test_many_concurrent_statements_through_the_pooler(pooled: str) -> None:
    # More clients than the pooler has server connections: statements move between
    # server sessions all the time, and none may fail for a missing prepared statement.
    url = with_query(pooled, table=unique("busy"), max_size=8)
    async with backend(url) as one, backend(url) as two:

        async def cycle(b: Backend, i: int) -> None:
            name = unique(f"busy{i}")
            for _ in range(15):
                granted = await grant(b, name, f"owner-{i}", ttl=30)
                other = two if b is one else one
                holder = await refused(other, name, "other")
                assert (holder.owner, holder.token) == (f"owner-{i}", granted.token)
                assert not await other.release(name, "other", None)  # leaves the queue
                renewed = await b.renew(name, f"owner-{i}", granted.token, 30)
                assert renewed.token == granted.token
                assert await b.release(name, f"owner-{i}", granted.token)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(24):
                    tg.start_soon(cycle, one if i % 2 else two, i)


@pytest.mark.parametrize("mode", MODES)
async def test_acquire_renew_release_and_hand_off_across_two_backends(
    pooled: str, pg: str, mode: str
) -> None:
    url = mode_url(pooled, pg, mode, poll_interval=0.1)
    async with backend(url) as first, backend(url) as second:
        name = unique("handoff")
        lease = await AsyncLock(first, name, ttl=30).acquire()
        seen = await refused(second, name, "owner-2")
        assert (seen.owner, seen.token) == (lease.owner, lease.token)
        assert not await second.release(name, "owner-2", None)  # leaves the queue
        await lease.renew()
        again = await second.read(name)
        assert again is not None and (again.owner, again.token) == (lease.owner, lease.token)
        got: list[int] = []

        async def take() -> None:
            taken = await AsyncLock(second, name, ttl=30).acquire()
            got.append(taken.token)
            assert await taken.release()

        with anyio.fail_after(30):  # a hang guard: polling notices the release in 0.1 s
            async with anyio.create_task_group() as tg:
                tg.start_soon(take)
                await waiting(second)
                assert await lease.release()
        assert got == [lease.token + 1]
        assert await first.read(name) is None


# -- waiting without LISTEN, and with a direct listener ------------------------------


async def test_nothing_listens_through_the_pooler_and_waiters_poll(pooled: str) -> None:
    async with backend(pooled, poll_interval=0.1) as waiter, backend(pooled) as holder_side:
        pg_waiter = inner(waiter, PostgresBackend)
        name = unique("poll")
        granted = await grant(holder_side, name, "owner-1", ttl=60)
        seen = await waiter.read(name)
        with anyio.fail_after(30):  # a hang guard: the holder's ttl (60 s) is not waited out
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter.wait_changed, name, seen)
                await waiting(waiter)
                assert await holder_side.release(name, "owner-1", granted.token)
        stats = pg_waiter.statistics()
        assert not stats.listening
        assert stats.listener_connects == 0


async def test_without_a_listener_a_wait_ends_when_the_holder_expires(pooled: str) -> None:
    # Polls are an hour apart: only the holder's remaining ttl can end this wait.
    async with backend(pooled, poll_interval=3600) as waiter, backend(pooled) as holder_side:
        name = unique("expiry")
        await grant(holder_side, name, "owner-1", ttl=1)
        seen = await waiter.read(name)
        assert seen is not None
        with anyio.fail_after(30):  # a hang guard, far below the poll interval
            await waiter.wait_changed(name, seen)
        assert await waiter.read(name) is None
        assert isinstance(await grant(waiter, name, "owner-2"), Grant)


async def test_a_direct_listener_pushes_while_statements_go_through_the_pooler(
    pooled: str, pg: str
) -> None:
    app = unique("aiolease_listener")
    url = with_query(pooled, listen_url=with_query(pg, application_name=app))
    # The holder's side listens nowhere: the waiter's listener is the only one.
    async with backend(url, poll_interval=60) as waiter, backend(pooled) as holder_side:
        pg_waiter = inner(waiter, PostgresBackend)
        name = unique("push")
        granted = await grant(holder_side, name, "owner-1", ttl=60)
        seen = await waiter.read(name)
        assert isinstance(seen, HolderInfo)
        async with changed(waiter, name, seen):  # a wait ended by a notification
            assert pg_waiter.statistics().listening
            # The listener is the one connection made with listen_url's application_name
            # (a LISTEN through the pooler would have let its session go back to the pool).
            listeners = await raw(
                pg, "SELECT query FROM pg_stat_activity WHERE application_name = $1", app
            )
            assert len(listeners) == 1, listeners
            assert await holder_side.release(name, "owner-1", granted.token)
