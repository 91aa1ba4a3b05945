"""The FastAPI example (docs/examples/fastapi_app.py) served by real uvicorn processes on
real Redis and PostgreSQL servers: one leader job at a time across the processes, a
SIGKILL of the leader's process moves the job, a crashing job is campaigned again while
the app serves, ``on_crash="exit"`` stops the server, and per-request locks never overlap
and hand out increasing tokens.

The client runs on asyncio only: what is tested is in the uvicorn processes (which run
on asyncio), not in the client.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest
from anyio.abc import Process

from tests.integrations.examples import ROOT, URL_ENV
from tests.support import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Server:
    """One uvicorn process."""

    proc: Process
    base: str
    log: Any

    def output(self) -> str:
        self.log.seek(0)
        return str(self.log.read().decode(errors="replace"))


@asynccontextmanager
async def uvicorn(factory: str, url: str) -> AsyncIterator[Server]:
    """``uvicorn tests.integrations.examples:<factory> --factory`` on a socket bound here
    (no port race), killed at the end."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    env = {**os.environ, URL_ENV: url, "PYTHONPATH": str(ROOT)}
    with sock, tempfile.TemporaryFile() as log:
        command = [sys.executable, "-m", "uvicorn", f"tests.integrations.examples:{factory}"]
        command += ["--factory", "--fd", str(sock.fileno()), "--log-level", "warning"]
        proc = await anyio.open_process(
            command, env=env, cwd=ROOT, pass_fds=[sock.fileno()], stdout=log, stderr=log
        )
        try:
            yield Server(proc, f"http://127.0.0.1:{port}", log)
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def health(client: httpx.AsyncClient, server: Server) -> dict[str, Any] | None:
    """The server's ``/health``, or ``None`` while it cannot answer."""
    try:
        response = await client.get(f"{server.base}/health")
    except httpx.TransportError:
        return None
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def started(client: httpx.AsyncClient, *servers: Server) -> None:
    async def up() -> bool:
        for server in servers:
            assert server.proc.returncode is None, server.output()
        return all([await health(client, server) is not None for server in servers])

    await eventually(up, "the uvicorn processes serving", within=30)


async def leaders(client: httpx.AsyncClient, servers: list[Server]) -> list[Server]:
    found = []
    for server in servers:
        body = await health(client, server)
        if body is not None and body["leading"]:
            found.append(server)
    return found


async def charges(client: httpx.AsyncClient, servers: list[Server], count: int) -> None:
    """``count`` concurrent charges of one invoice, spread over ``servers``: each is
    granted (200), their locked spans do not overlap, and their tokens increase in the
    order of the spans."""
    results: list[dict[str, Any]] = []

    async def charge(i: int) -> None:
        response = await client.post(f"{servers[i % len(servers)].base}/invoices/42/charge")
        assert response.status_code == 200, response.text
        results.append(response.json())

    async with anyio.create_task_group() as tg:
        for i in range(count):
            tg.start_soon(charge, i)
    results.sort(key=lambda r: r["span"][0])
    for before, after in zip(results, results[1:], strict=False):
        assert before["span"][1] <= after["span"][0], (before, after)
        assert before["token"] < after["token"], (before, after)


@pytest.fixture(params=["redis", "postgres"])
def app_url(request: pytest.FixtureRequest) -> str:
    """Each real server the example is run on."""
    url: str = request.getfixturevalue(f"{request.param}_app_url")
    return url


async def test_two_processes_one_leader_locks_and_failover(app_url: str) -> None:
    url = app_url
    async with AsyncExitStack() as stack:
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        servers = [await stack.enter_async_context(uvicorn("fastapi_app", url)) for _ in "ab"]
        await started(client, *servers)

        async def one_leader() -> bool:
            return len(await leaders(client, servers)) == 1

        await eventually(one_leader, "one leader")
        for _ in range(10):
            assert len(await leaders(client, servers)) <= 1
        (leader,) = await leaders(client, servers)
        body = await health(client, leader)
        assert body is not None
        shown = (await client.get(f"{servers[1].base}/leader")).json()
        assert shown["identity"] == body["jobs"]["scheduler"]["identity"]
        assert shown["token"] == body["jobs"]["scheduler"]["token"]

        await charges(client, servers, 30)

        leader.proc.send_signal(signal.SIGKILL)
        (other,) = [s for s in servers if s is not leader]

        async def moved() -> bool:
            return [s.base for s in await leaders(client, [other])] == [other.base]

        await eventually(moved, "the job moving to the other process", within=15)
        after = await health(client, other)
        assert after is not None and after["jobs"]["scheduler"]["token"] > shown["token"]
        await charges(client, [other], 3)


async def test_a_crashing_job_is_campaigned_again_and_the_app_keeps_serving(
    app_url: str,
) -> None:
    async with uvicorn("crashing_fastapi_app", app_url) as server:
        async with httpx.AsyncClient(timeout=30) as client:
            await started(client, server)

            async def recovered() -> bool:
                body = await health(client, server)
                assert body is not None and body["backend"] == "open"
                response = await client.post(f"{server.base}/invoices/7/charge")
                assert response.status_code == 200, response.text
                flaky = body["jobs"]["flaky"]
                return bool(flaky["crashes"] == 2 and flaky["leading"])

            await eventually(recovered, "the flaky job leading after two crashes")
            assert server.proc.returncode is None
        log = server.output()
    assert "leader job 'flaky' crashed (crash 2)" in log, log
    assert "RuntimeError: flaky crashes in term 2" in log, log  # with its traceback


async def test_on_crash_exit_stops_the_server_by_sigterm(redis_app_url: str) -> None:
    async with uvicorn("exiting_fastapi_app", redis_app_url) as server:
        with anyio.fail_after(30):
            code = await server.proc.wait()
        log = server.output()
    assert code == -signal.SIGTERM, log
    assert "leader job 'doomed' crashed and on_crash='exit': stopping the app" in log, log
