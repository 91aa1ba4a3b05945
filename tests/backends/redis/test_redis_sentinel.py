"""The Redis backend on a Sentinel-managed master (``scripts/services.sh start
redis-sentinel``: master 6390, replica 6391, a Sentinel on 26379): the conformance
suite, the ``WAIT`` option, and a failover that kills the master.

Each test works under its own key prefix and deletes its keys afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
from redis.sentinel import MasterNotFoundError, Sentinel

import aiolease
from aiolease import AsyncLock, BackendError, Capability
from aiolease.abc import Backend
from aiolease.backends.redis._keys import Keys
from aiolease.testing import CHECKS, Check
from aiolease.testing.pytest_plugin import server_missing
from aiolease.testing.servers import services_dir
from tests.backends.redis.support import Tap, inner
from tests.support import eventually

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[3]
SERVICE = "aiolease"


def master(url: str) -> redis.Redis:
    """A blocking client of the current master."""
    hosts = url.split("//", 1)[1].split("/", 1)[0]
    addresses = [(h, int(p)) for h, p in (a.rsplit(":", 1) for a in hosts.split(","))]
    sentinel = Sentinel(addresses)  # type: ignore[no-untyped-call]
    return sentinel.master_for(SERVICE)  # type: ignore[no-any-return,no-untyped-call]


@pytest.fixture
def prefix(sentinel_url: str) -> Iterator[str]:
    prefix = f"aiolease-test-{uuid.uuid4().hex[:12]}:"
    yield prefix
    with master(sentinel_url) as client:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)


def open_redis(url: str, **options: Any) -> AbstractAsyncContextManager[Backend]:
    """``open_backend`` (a ``redis+sentinel`` URL)."""
    return aiolease.open_backend(url, **options)


# Once per loop, each loop with one of the two WAIT settings (docs/testing.md,
# "Keeping the suite short"): every check meets both loops and both settings.
@pytest.mark.parametrize(("anyio_backend", "wait"), [("asyncio", 0), ("trio", 1)])
@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
async def test_conformance(
    anyio_backend: str, sentinel_url: str, prefix: str, check: Check, wait: int
) -> None:
    if wait:
        await wait_replicated(sentinel_url)
    await check(lambda: open_redis(sentinel_url, prefix=prefix, wait_replicas=wait))


async def test_a_grant_that_misses_its_replicas_is_not_confirmed(
    anyio_backend: str, sentinel_url: str, prefix: str
) -> None:
    """Asking for more replicas than exist: the grant is undone and reported as an
    error, never handed out."""
    await wait_replicated(sentinel_url)
    async with open_redis(sentinel_url, prefix=prefix, wait_replicas=5, wait_timeout=0.05) as b:
        assert Capability.DURABLE_TOKENS not in b.capabilities
        with pytest.raises(BackendError, match="reached 1 of the 5 replicas"):
            await AsyncLock(b, "job", ttl=30).acquire_nowait()
        assert await b.read("job") is None
    async with open_redis(f"{sentinel_url}?wait_replicas=1", prefix=prefix) as b:
        async with AsyncLock(b, "job", ttl=30) as lease:
            assert lease.token >= 1


async def test_a_fair_waiter_that_waits_for_replicas_is_woken_not_spinning(
    anyio_backend: str, sentinel_url: str, prefix: str
) -> None:
    """Fair mode with ``wait_replicas``: no hand-off tickets, so a waiter is woken by
    the name's channel and asks again; it does not retry in a loop meanwhile."""
    await wait_replicated(sentinel_url)
    async with open_redis(sentinel_url, prefix=prefix, fair=True, wait_replicas=1) as backend:
        tap = Tap(inner(backend))
        watched = Keys.of(prefix, "job").watched
        holder = await AsyncLock(tap, "job", ttl=30).acquire_nowait()
        got: list[int] = []

        async def waiter() -> None:
            async with AsyncLock(tap, "job", ttl=30) as lease:
                got.append(lease.token)

        with anyio.fail_after(10):  # far below the holder's ttl
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await tap.wait_for(lambda: tap.calls["wait_turn"] >= 1)
                # it waits for a change of holder, which marks the name watched first
                with master(sentinel_url) as client:
                    await eventually(lambda: bool(client.exists(watched)), "the watch mark")
                await holder.release()
        assert got and got[0] > holder.token
        assert tap.calls["try_acquire"] == 3  # holder, refused once, granted


def _master_port(url: str) -> int | None:
    """The master's port as Sentinel reports it; None while it has none."""
    hosts = url.split("//", 1)[1].split("/", 1)[0]
    addresses = [(h, int(p)) for h, p in (a.rsplit(":", 1) for a in hosts.split(","))]
    try:
        sentinel = Sentinel(addresses)  # type: ignore[no-untyped-call]
        _, port = sentinel.discover_master(SERVICE)  # type: ignore[no-untyped-call]
    except MasterNotFoundError:
        return None
    return int(port)


def _master_pidfile(url: str) -> Path:
    return services_dir() / "redis-sentinel" / f"n{_master_port(url)}" / "redis.pid"


@pytest.mark.slow
# A server fault, run once (docs/testing.md, "Keeping the suite short"); the other
# Sentinel tests run under both loops.
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_lock_works_again_after_the_master_is_killed(
    anyio_backend: str, sentinel_url: str, prefix: str
) -> None:
    """SIGKILL the master: Sentinel promotes the replica, and the same backend object
    grants leases again through the new master."""
    pidfile = _master_pidfile(sentinel_url)
    if not pidfile.exists():
        why = f"the failover test needs the redis-sentinel service's own master ({pidfile})"
        server_missing(why)
    await wait_replicated(sentinel_url)  # an earlier run of this test restarted it
    async with open_redis(sentinel_url, prefix=prefix, wait_replicas=1) as backend:
        lock = AsyncLock(backend, "job", ttl=30)
        async with lock as before:
            pass
        killed = _master_port(sentinel_url)
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
        try:
            with anyio.fail_after(30):
                # Sentinel's own schedule: there is nothing to await.
                while _master_port(sentinel_url) in (killed, None):  # noqa: ASYNC110
                    await anyio.sleep(0.1)
            # The killed master comes back as a replica of the new one, so that WAIT
            # for one replica can succeed again.
            await start_service()
            with anyio.fail_after(30):
                while True:
                    try:
                        lease = await lock.acquire(timeout=5)
                        break
                    except (BackendError, TimeoutError):
                        await anyio.sleep(0.2)  # Sentinel has not promoted the replica yet
            try:
                # The token survived: the counter reached the replica before the kill
                # (WAIT confirmed it).
                assert lease.token > before.token
            finally:
                await lease.release()
        finally:
            await start_service()


async def start_service() -> None:
    await anyio.run_process(
        ["bash", "scripts/services.sh", "start", "redis-sentinel"], cwd=REPO, stderr=subprocess.PIPE
    )


async def wait_replicated(url: str) -> None:
    """Wait until the master has a replica in sync (after an earlier failover test,
    the old master rejoins as a replica a few seconds after it restarts, and is
    connected before its first sync is over: only an ``online`` one acknowledges)."""
    with anyio.fail_after(60):
        while True:
            with master(url) as client:
                replication = client.info("replication")
                replicas = int(replication.get("connected_slaves", 0))
                states = [replication.get(f"slave{i}", {}).get("state") for i in range(replicas)]
                if "online" in states:
                    return
            await anyio.sleep(0.2)  # Sentinel and the replica's sync: nothing to await
