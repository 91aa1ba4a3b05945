"""The Redis backend on a real Redis Cluster (three masters, ``scripts/services.sh
start redis-cluster``): the conformance suite, and every key of a name (its permits' too)
in one slot.

Each test works under its own key prefix and deletes its keys afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot

import aiolease
from aiolease import AsyncLock, AsyncSemaphore, Capability, InvalidArgument
from aiolease.abc import Backend
from aiolease.backends.redis import RedisBackend
from aiolease.backends.redis._keys import Keys, PermitKeys
from aiolease.testing import CHECKS, Check

pytestmark = pytest.mark.anyio


def sync_cluster(url: str) -> RedisCluster:
    addresses = (a.split(":") for a in url.split("//", 1)[1].split(","))
    nodes = [ClusterNode(h, int(p)) for h, p in addresses]  # type: ignore[no-untyped-call]
    return RedisCluster(startup_nodes=nodes)


@pytest.fixture
def prefix(cluster_url: str) -> Iterator[str]:
    """A key prefix of this test alone; its keys are deleted afterwards."""
    prefix = f"aiolease-test-{uuid.uuid4().hex[:12]}:"
    yield prefix
    with sync_cluster(cluster_url) as client:
        for node in client.get_primaries():
            keys = list(client.scan_iter(match=f"{prefix}*", count=1000, target_nodes=node))
            for key in keys:
                client.delete(key)


def open_redis(url: str, **options: Any) -> AbstractAsyncContextManager[Backend]:
    """``open_backend`` (a ``redis+cluster`` URL)."""
    return aiolease.open_backend(url, **options)


# Once per loop, each loop with one of the two modes, paired the other way
# round from the single server's (docs/testing.md, "Keeping the
# suite short"): every check meets both loops and both modes.
@pytest.mark.parametrize(("anyio_backend", "fair"), [("asyncio", True), ("trio", False)])
@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
async def test_conformance(
    anyio_backend: str, cluster_url: str, prefix: str, check: Check, fair: bool
) -> None:
    await check(lambda: open_redis(cluster_url, prefix=prefix, fair=fair))


async def test_the_keys_of_a_name_live_in_one_slot(
    anyio_backend: str, cluster_url: str, prefix: str
) -> None:
    names = ["a", "b{c}", "zzz/ü", "x}y{"]
    async with open_redis(cluster_url, prefix=prefix, fair=True) as backend:
        assert Capability.DURABLE_TOKENS not in backend.capabilities
        assert "cluster" in repr(backend)
        for name in names:
            async with AsyncLock(backend, name, ttl=30) as lease:
                assert lease.token == 1
    slots = {key_slot(Keys.of(prefix, n).lease) for n in names}
    assert len(slots) > 1  # the names spread over the cluster ...
    with sync_cluster(cluster_url) as client:
        for name in names:
            keys = Keys.of(prefix, name)
            wanted = [keys.lease, keys.token, keys.queue, keys.waiters]
            assert {key_slot(k) for k in wanted} == {key_slot(keys.lease)}  # ... one slot each
            assert client.get(keys.token) == b"1"  # the counter is where the script wrote it


async def test_cluster_keeps_a_names_permit_keys_in_one_slot(
    anyio_backend: str, cluster_url: str, prefix: str
) -> None:
    names = ["a", "b{c}", "zzz/ü", "x}y{"]
    async with open_redis(cluster_url, prefix=prefix) as backend:
        for name in names:
            async with AsyncSemaphore(backend, name, limit=2, ttl=30) as permit:
                assert permit.token == 1
                permits = await backend.read_permits(name)
                assert permits is not None and permits.used == 1
    assert len({key_slot(Keys.of(prefix, n).lease) for n in names}) > 1
    with sync_cluster(cluster_url) as client:
        for name in names:
            keys = PermitKeys.of(prefix, name)
            slots = {key_slot(k) for k in keys.all}
            assert slots == {key_slot(Keys.of(prefix, name).lease)}
            assert client.get(keys.token) == b"1"


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://127.0.0.1:7000/0",
        "redis+cluster://127.0.0.1",
        "redis+cluster://127.0.0.1:7000?db=1",
        "redis+cluster://127.0.0.1:7000?wait_replicas=1",
    ],
)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # parsing does not depend on the loop
async def test_bad_cluster_urls_are_invalid(anyio_backend: str, url: str) -> None:
    with pytest.raises(InvalidArgument):
        await RedisBackend.from_url(url)
