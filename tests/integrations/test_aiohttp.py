"""aiolease.integrations.aiohttp, and the aiohttp example (docs/examples/aiohttp_app.py)
served by aiohttp's test server: on Redis, two apps elect one leader, their per-request
locks never overlap and hand out increasing tokens, and stopping the leader's app moves
the job; on the memory backend, the error responses, crashes and the check of the
routes' lock names.

aiohttp runs on asyncio only, so these tests do too.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from aiolease import BackendNotFound, InvalidArgument, Lease
from aiolease.backends.memory import MemoryBackend
from aiolease.integrations.aiohttp import Leases
from tests.integrations.examples import TTL, example
from tests.support import eventually

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    """``app`` on a real socket (its startup and cleanup run), and a client for it."""
    async with TestClient(TestServer(app)) as client:
        yield client


async def test_the_example_on_redis_one_leader_locks_and_failover(redis_app_url: str) -> None:
    module = example("aiohttp_app")
    async with AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(serving(module.create_app(redis_app_url, ttl=TTL)))
            for _ in "ab"
        ]

        async def leading() -> list[TestClient[web.Request, web.Application]]:
            found = []
            for client in clients:
                response = await client.get("/health")
                assert response.status == 200
                if (await response.json())["leading"]:
                    found.append(client)
            return found

        async def one_leader() -> bool:
            return len(await leading()) == 1

        await eventually(one_leader, "one leader")
        (leader,) = await leading()
        shown = await (await clients[1].get("/leader")).json()
        assert shown["token"] == leader.app[module.LEASES].status()["jobs"]["scheduler"]["token"]

        results: list[dict[str, Any]] = []

        async def charge(i: int) -> None:
            response = await clients[i % 2].post("/invoices/42/charge")
            assert response.status == 200, await response.text()
            results.append(await response.json())

        async with anyio.create_task_group() as tg:
            for i in range(30):
                tg.start_soon(charge, i)
        results.sort(key=lambda r: r["span"][0])
        for before, after in zip(results, results[1:], strict=False):
            assert before["span"][1] <= after["span"][0], (before, after)
            assert before["token"] < after["token"], (before, after)

        # Stopping the leader's app (its cleanup) resigns: the other leads at once.
        await leader.close()
        clients.remove(leader)
        await eventually(one_leader, "the other app leading")
        assert (await (await clients[0].get("/leader")).json())["token"] > shown["token"]


def locking_app(leases: Leases, timeout: float | None) -> tuple[web.Application, list[str]]:
    """An app whose ``/invoices/{invoice_id}`` holds a lock, and notes what its handler
    did: "start <token>", then "end <token>" unless it was cancelled."""
    notes: list[str] = []

    @leases.locked("invoices/{invoice_id}", ttl=1, timeout=timeout)
    async def charge(request: web.Request, lease: Lease) -> web.Response:
        notes.append(f"start {lease.token}")
        await anyio.sleep(float(request.query.get("hold", 0)))
        notes.append(f"end {lease.token}")
        return web.json_response({"token": lease.token, "name": lease.name})

    app = web.Application()
    app.router.add_post("/invoices/{invoice_id}", charge)
    app.cleanup_ctx.append(leases.cleanup_ctx)
    return app, notes


async def test_held_and_lost_locks_map_to_their_statuses() -> None:
    backend = MemoryBackend()
    assert await backend.try_acquire("invoices/1", "other", 30, "other-host:1", {})
    app, notes = locking_app(Leases(backend, held_status=423), 0)
    async with serving(app) as client:
        response = await client.post("/invoices/1")
        assert response.status == 423
        assert response.headers["Retry-After"] == "1"
        assert await response.json() == {"detail": "locked: try again later", "lock": "invoices/1"}
        assert notes == []

        async def steal() -> None:
            await eventually(lambda: notes == ["start 1"], "the handler running")
            holder = await backend.read("invoices/2")
            assert holder is not None
            assert await backend.release("invoices/2", holder.owner, None)

        async with anyio.create_task_group() as tg:
            tg.start_soon(steal)
            response = await client.post("/invoices/2?hold=30")
        assert response.status == 503
        body = await response.json()
        assert body == {"detail": "lock lost while the request ran: stolen", "lock": "invoices/2"}
        assert notes == ["start 1"]  # cancelled: no "end"

        response = await client.post("/invoices/2")
        assert response.status == 200
        assert await response.json() == {"token": 2, "name": "invoices/2"}

        response = await client.post("/invoices/" + "x" * 300)  # no valid lease name
        assert response.status == 400
        assert await response.json() == {
            "detail": "the request's parameters make no valid lock name"
        }


async def test_a_crashing_job_is_logged_and_campaigned_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = MemoryBackend()
    leases = Leases(backend, restart_backoff=0.01)
    tokens: list[int] = []

    @leases.leader_job("job", ttl=1)
    async def job(lease: Lease) -> None:
        tokens.append(lease.token)
        if len(tokens) == 1:
            raise RuntimeError("crash in term 1")
        await anyio.sleep_forever()

    app, _ = locking_app(leases, None)
    with caplog.at_level(logging.ERROR, logger="aiolease.integrations"):
        async with serving(app) as client:
            await eventually(lambda: leases.leading("job"), "a second term")
            assert (await client.post("/invoices/5")).status == 200
            assert leases.status()["backend"] == "open"
    assert tokens == [1, 2]
    (record,) = [r for r in caplog.records if r.name == "aiolease.integrations"]
    assert (
        record.getMessage() == "leader job 'job' crashed (crash 1): RuntimeError('crash in term 1')"
    )
    assert record.exc_info is not None
    assert await backend.read("job") is None  # resigned at cleanup
    assert leases.status()["backend"] == "closed"


async def test_on_crash_exit_calls_stop() -> None:
    stopped = anyio.Event()
    leases = Leases("memory://", on_crash="exit", stop=stopped.set)

    @leases.leader_job("job", ttl=1)
    async def job(lease: Lease) -> None:
        raise RuntimeError("crash")

    app, _ = locking_app(leases, None)
    async with serving(app) as client:
        await stopped.wait()
        assert (await client.post("/invoices/5")).status == 200  # still open meanwhile
    assert leases.exit_code == 1


async def test_a_lock_naming_a_missing_match_info_key_stops_the_app_at_start() -> None:
    leases = Leases("memory://")

    @leases.locked("invoices/{invoice_id}", ttl=1)
    async def order(request: web.Request, lease: Lease) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/orders/{order_id}", order)
    app.cleanup_ctx.append(leases.cleanup_ctx)
    with pytest.raises(InvalidArgument, match="invoice_id.*'/orders/{order_id}'"):
        await TestServer(app).start_server()


async def test_a_backend_that_cannot_be_opened_stops_the_app_at_start() -> None:
    leases = Leases("nosuchscheme://x")
    app = web.Application()
    app.cleanup_ctx.append(leases.cleanup_ctx)
    with pytest.raises(BackendNotFound, match="nosuchscheme"):
        await TestServer(app).start_server()
