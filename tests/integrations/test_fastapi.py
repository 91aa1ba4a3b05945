"""aiolease.integrations.fastapi in one process, on the memory backend, under asyncio and
trio (Starlette and FastAPI run on anyio): the app's life, leader jobs and their crashes,
per-request locks and the responses they map to.

No ``from __future__ import annotations`` here: FastAPI reads the dependencies from the
annotations of functions local to the tests."""

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import anyio
import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aiolease import BackendUnavailable, InvalidArgument, LeaderInfo, Lease
from aiolease.backends.memory import MemoryBackend
from aiolease.integrations.fastapi import Leases
from tests.support import eventually

pytestmark = pytest.mark.anyio

TTL = 1.0


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app's lifespan, and a client that calls it in this process."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            yield client


def locking_app(leases: Leases, timeout: float | None) -> tuple[FastAPI, list[str]]:
    """An app whose ``/invoices/{invoice_id}`` holds a lock, and notes what its handler
    did: "start <token>", then "end <token>" unless it was cancelled."""
    app = FastAPI()
    leases.install(app)
    notes: list[str] = []
    InvoiceLock = Annotated[Lease, leases.lock("invoices/{invoice_id}", ttl=TTL, timeout=timeout)]

    @app.post("/invoices/{invoice_id}")
    async def charge(invoice_id: str, lease: InvoiceLock, hold: float = 0.0) -> dict[str, Any]:
        notes.append(f"start {lease.token}")
        await anyio.sleep(hold)
        notes.append(f"end {lease.token}")
        return {"token": lease.token, "name": lease.name}

    return app, notes


async def test_the_lock_is_held_while_the_handler_runs_and_released_before_the_response() -> None:
    backend = MemoryBackend()
    leases = Leases(backend)
    app, _ = locking_app(leases, None)
    seen: list[object] = []

    async def middleware(scope: Any, receive: Any, send: Any) -> None:
        async def sending(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                seen.append(await backend.read("invoices/7"))
            await send(message)

        await inner(scope, receive, sending)

    inner = app.build_middleware_stack()
    app.middleware_stack = middleware
    async with serving(app) as client:
        first = await client.post("/invoices/7")
        second = await client.post("/invoices/7")
    assert first.json() == {"token": 1, "name": "invoices/7"}
    assert second.json()["token"] == 2
    assert seen == [None, None]  # released when the handler returned, before sending


async def test_a_held_lock_maps_to_409_without_waiting_and_after_a_wait() -> None:
    backend = MemoryBackend()
    holder = await backend.try_acquire("invoices/1", "other", 30, "other-host:1", {})
    for timeout in (0, 0.05):
        leases = Leases(backend)
        app, notes = locking_app(leases, timeout)
        async with serving(app) as client:
            response = await client.post("/invoices/1")
        assert response.status_code == 409
        assert response.headers["retry-after"] == "1"
        assert response.json() == {"detail": "locked: try again later", "lock": "invoices/1"}
        assert "other-host" not in response.text  # the holder is not shown to clients
        assert notes == []
    assert holder is not None


async def test_a_lost_lock_cancels_the_handler_and_maps_to_503() -> None:
    backend = MemoryBackend()
    leases = Leases(backend, lost_status=500)
    app, notes = locking_app(leases, None)
    async with serving(app) as client, anyio.create_task_group() as tg:

        async def steal() -> None:
            await eventually(lambda: notes == ["start 1"], "the handler running")
            assert await backend.release("invoices/3", (await holder()).owner, None)

        async def holder() -> Any:
            found = await backend.read("invoices/3")
            assert found is not None
            return found

        tg.start_soon(steal)
        response = await client.post("/invoices/3", params={"hold": 30})
    assert response.status_code == 500
    assert response.json() == {
        "detail": "lock lost while the request ran: stolen",
        "lock": "invoices/3",
    }
    assert notes == ["start 1"]  # cancelled: no "end"


async def test_concurrent_requests_take_turns_with_increasing_tokens() -> None:
    leases = Leases(MemoryBackend())
    app, notes = locking_app(leases, None)
    async with serving(app) as client, anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(client.post, "/invoices/9?hold=0.001")
    tokens = [int(note.split()[1]) for note in notes]
    assert tokens == sorted(tokens) == [t for t in range(1, 11) for _ in "se"]
    assert notes[::2] == [f"start {t}" for t in range(1, 11)]


async def test_a_name_made_invalid_by_the_client_is_a_400() -> None:
    leases = Leases(MemoryBackend())
    app, notes = locking_app(leases, None)
    async with serving(app) as client:
        response = await client.post("/invoices/" + "x" * 300)
    assert response.status_code == 400
    assert response.json() == {"detail": "the request's parameters make no valid lock name"}
    assert notes == []


async def test_a_lock_naming_a_missing_path_parameter_stops_the_app_at_start() -> None:
    leases = Leases(MemoryBackend())
    app = FastAPI()
    leases.install(app)

    @app.get("/orders/{order_id}")
    async def order(lease: Annotated[Lease, leases.lock("invoices/{invoice_id}", ttl=TTL)]) -> None:
        pass

    with pytest.raises(InvalidArgument, match="invoice_id.*'/orders/{order_id}'"):
        async with app.router.lifespan_context(app):
            pass


@pytest.mark.parametrize(
    "template", ["invoices/{}", "invoices/{0}", "a/{x.y}", "a/{x!r}", "a/{x:>3}", "a/{", 42, ""]
)
def test_bad_lock_names_are_refused_where_declared(template: Any) -> None:
    with pytest.raises(InvalidArgument):
        Leases("memory://").lock(template, ttl=TTL)


@pytest.mark.parametrize(
    "options",
    [{"on_crash": "ignore"}, {"held_status": 200}, {"lost_status": True}, {"restart_backoff": -1}],
)
def test_bad_options_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        Leases("memory://", **options)
    with pytest.raises(InvalidArgument):
        Leases(object())  # type: ignore[arg-type]


def test_bad_job_options_are_refused_where_declared() -> None:
    leases = Leases("memory://")
    with pytest.raises(InvalidArgument):
        leases.leader_job("job", ttl=-1)
    with pytest.raises(InvalidArgument):
        leases.leader_job("job", ttl=1, on_crash="sometimes")  # type: ignore[arg-type]
    leases.leader_job("job", ttl=1)(anyio.sleep_forever)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="already"):
        leases.leader_job("job", ttl=1)
    with pytest.raises(InvalidArgument, match="no leader job"):
        leases.is_leader("other")


def crashing(times: int) -> tuple[Callable[[Lease], Awaitable[None]], list[int]]:
    """A job that crashes in its first ``times`` terms, then runs until cancelled; and
    the tokens of its terms."""
    tokens: list[int] = []

    async def job(lease: Lease) -> None:
        tokens.append(lease.token)
        if len(tokens) <= times:
            raise RuntimeError(f"crash in term {len(tokens)}")
        await anyio.sleep_forever()

    return job, tokens


async def test_a_crashing_job_is_logged_and_campaigned_again_while_the_app_serves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = MemoryBackend()
    leases = Leases(backend, restart_backoff=0.01)
    job, tokens = crashing(2)
    leases.leader_job("job", ttl=TTL)(job)
    app = FastAPI()
    leases.install(app)

    @app.get("/health")
    async def health(
        leading: Annotated[bool, leases.is_leader("job")],
        leader: Annotated[LeaderInfo | None, leases.current_leader("job")],
    ) -> dict[str, Any]:
        return {"leading": leading, "leader": None if leader is None else leader.token}

    with caplog.at_level(logging.ERROR, logger="aiolease.integrations"):
        async with serving(app) as client:
            await eventually(lambda: len(tokens) == 3 and leases.leading("job"), "a third term")
            response = await client.get("/health")
            assert response.json() == {"leading": True, "leader": 3}
            assert leases.status() == {
                "backend": "open",
                "jobs": {
                    "job": {
                        "leading": True,
                        "token": 3,
                        "identity": leases.status()["jobs"]["job"]["identity"],  # type: ignore[index]
                        "terms": 3,
                        "crashes": 2,
                        "last_crash": "RuntimeError",
                    }
                },
            }
    assert tokens == [1, 2, 3]
    crashes = [r for r in caplog.records if r.name == "aiolease.integrations"]
    assert [r.getMessage() for r in crashes] == [
        "leader job 'job' crashed (crash 1): RuntimeError('crash in term 1')",
        "leader job 'job' crashed (crash 2): RuntimeError('crash in term 2')",
    ]
    assert all(r.exc_info is not None and r.__dict__["job"] == "job" for r in crashes)
    assert await backend.read("job") is None  # the job resigned when the app stopped
    assert leases.status()["backend"] == "closed"


async def test_on_crash_exit_calls_stop_and_keeps_the_backend_open_until_the_app_stops() -> None:
    stopped = anyio.Event()
    leases = Leases("memory://", on_crash="exit", stop=stopped.set)
    job, tokens = crashing(1)
    leases.leader_job("job", ttl=TTL)(job)
    app = FastAPI()
    leases.install(app)
    app.get("/")(lambda: None)
    async with serving(app) as client:
        await stopped.wait()
        assert (await client.get("/")).status_code == 200
        assert leases.status()["backend"] == "open"
        await anyio.sleep(0.05)  # no campaign again: the job stays stopped
        assert tokens == [1]
    assert leases.crash is not None and leases.exit_code == 1


async def test_the_apps_own_lifespan_runs_inside_with_the_backend_open() -> None:
    backend = MemoryBackend()
    leases = Leases(backend)
    events: list[str] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        events.append(f"start {leases.backend is backend}")
        yield {"greeting": "hi"}
        events.append(f"stop {leases.backend is backend}")

    app = FastAPI(lifespan=lifespan)
    leases.install(app)
    async with app.router.lifespan_context(app) as state:
        assert state == {"greeting": "hi"}  # the app's own state, passed on
        with pytest.raises(RuntimeError, match="already"):
            async with leases.running():
                pass
    assert events == ["start True", "stop True"]
    with pytest.raises(RuntimeError, match="not open"):
        assert leases.backend
    assert await backend.try_acquire("x", "o", 1, "i", {}) is not None  # not closed


async def test_a_backend_opened_from_a_url_is_closed_when_the_app_stops(tmp_path: Path) -> None:
    leases = Leases(f"sqlite:///{tmp_path}/leases.db")
    app = FastAPI()
    leases.install(app)
    async with serving(app):
        backend = leases.backend
        assert await backend.read("x") is None
    with pytest.raises(BackendUnavailable, match="closed"):
        await backend.read("x")


async def test_starlette_endpoints_hold_a_lock_with_the_same_responses() -> None:
    backend = MemoryBackend()
    assert await backend.try_acquire("invoices/1", "other", 30, "other-host:1", {})
    leases = Leases(backend)

    async def charge(request: Request) -> Response:
        async with leases.hold(request, "invoices/{invoice_id}", ttl=TTL, timeout=0) as lease:
            return JSONResponse({"token": lease.token})

    app = Starlette(routes=[Route("/invoices/{invoice_id}", charge, methods=["POST"])])
    leases.install(app)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            held = await client.post("/invoices/1")
            granted = await client.post("/invoices/2")
    assert held.status_code == 409
    assert held.json() == {"detail": "locked: try again later", "lock": "invoices/1"}
    assert granted.status_code == 200 and granted.json() == {"token": 1}
