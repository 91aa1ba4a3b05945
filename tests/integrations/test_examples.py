"""The worker examples of docs/examples/ against a real Redis server: the trio worker
(docs/examples/trio_worker.py) under trio, the scheduled job
(docs/examples/scheduled_job.py) under asyncio and trio. Two workers, one working at a
time; stop the one that works, and the other takes over with a higher token."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pytest

from aiolease import open_backend
from aiolease.abc import Backend
from tests.integrations.examples import TTL, example
from tests.support import eventually

pytestmark = pytest.mark.anyio

#: What a worker does, given its backend and its identity.
Worker = Callable[[Backend, str], Awaitable[None]]


async def one_at_a_time(url: str, worker: Worker, runs: list[tuple[str, int]]) -> None:
    """Two workers, ``a`` and ``b``, each on a backend of its own; ``runs`` is where
    they note (identity, token) each time they work."""
    async with open_backend(url) as a_backend, open_backend(url) as b_backend:
        async with anyio.create_task_group() as tg:
            scopes = {}
            for identity, backend in (("a", a_backend), ("b", b_backend)):
                scopes[identity] = scope = anyio.CancelScope()

                async def run(backend: Backend, identity: str, scope: anyio.CancelScope) -> None:
                    with scope:
                        await worker(backend, identity)

                tg.start_soon(run, backend, identity, scope)

            await eventually(lambda: len(runs) >= 3, "three runs")
            first, token = runs[0]
            assert {who for who, _ in runs} == {first}  # only the leader works
            scopes[first].cancel()  # that worker stops (its term is resigned)
            stopped_at = len(runs)
            other = "b" if first == "a" else "a"
            await eventually(lambda: len(runs) >= stopped_at + 2, "the other's runs")
            assert {who for who, _ in runs[stopped_at:]} == {other}
            assert all(t > token for _, t in runs[stopped_at:])
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_trio_worker(redis_app_url: str) -> None:
    module = example("trio_worker")
    runs: list[tuple[str, int]] = []

    async def worker(backend: Backend, identity: str) -> None:
        await module.worker(backend, identity, ttl=TTL, report=lambda *run: runs.append(run))

    await one_at_a_time(redis_app_url, worker, runs)


async def test_scheduled_job(redis_app_url: str) -> None:
    module = example("scheduled_job")
    runs: list[tuple[str, int]] = []

    async def worker(backend: Backend, identity: str) -> None:
        async def job(token: int) -> None:
            runs.append((identity, token))

        await module.scheduled(backend, job, interval=0.05, ttl=TTL, identity=identity)

    await one_at_a_time(redis_app_url, worker, runs)
