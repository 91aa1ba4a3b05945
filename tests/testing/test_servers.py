"""Every real server of the suite answers its own client library, where the fixtures say.

These are the servers that ``scripts/services.sh start`` provides. Each check speaks
the server's protocol through the driver the backend will use, so a port that is
open but serves something else fails here, not deep inside a backend test.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from urllib.parse import urlsplit

import pytest

from aiolease.testing import servers

pytestmark = pytest.mark.anyio

GetServer = Callable[[str], str]


@pytest.fixture
def anyio_backend() -> str:
    """The drivers checked here are asyncio libraries (trio reaches them through the bridge)."""
    return "asyncio"


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


async def test_redis(aiolease_server: GetServer) -> None:
    import redis.asyncio as redis

    client = redis.Redis.from_url(aiolease_server("redis"))
    try:
        key = f"aiolease-test:{uuid.uuid4().hex}"
        assert await client.set(key, b"v", px=10_000, nx=True)
        assert await client.get(key) == b"v"
        assert await client.delete(key) == 1
    finally:
        await client.aclose()


async def test_postgres(aiolease_server: GetServer) -> None:
    import asyncpg

    conn = await asyncpg.connect(aiolease_server("postgres"))
    try:
        assert await conn.fetchval("SELECT current_database()") == "test"
        assert await conn.fetchval("SELECT clock_timestamp() IS NOT NULL")
    finally:
        await conn.close()


async def test_mariadb(aiolease_server: GetServer) -> None:
    import asyncmy

    parts = urlsplit(aiolease_server("mariadb"))
    conn = await asyncmy.connect(
        host=parts.hostname,
        port=parts.port,
        user=parts.username,
        password=parts.password or "",
        database=parts.path.lstrip("/"),
    )
    try:
        async with conn.cursor() as cur:
            await cur.execute("SELECT DATABASE(), NOW(6)")
            row = await cur.fetchone()
        assert row is not None and row[0] == "test"
    finally:
        conn.close()


async def _etcd_roundtrip(host: str, port: int) -> None:
    import aetcd

    async with aetcd.Client(host=host, port=port) as client:
        key = f"/aiolease-test/{uuid.uuid4().hex}".encode()
        await client.put(key, b"v")
        got = await client.get(key)
        assert got is not None and got.value == b"v"
        await client.delete(key)


async def test_etcd(aiolease_server: GetServer) -> None:
    await _etcd_roundtrip(*_host_port(aiolease_server("etcd")))


async def test_etcd_cluster_every_member(aiolease_server: GetServer) -> None:
    aiolease_server("etcd-cluster")
    addresses = servers.server("etcd-cluster").addresses
    assert len(addresses) == 3
    for host, port in addresses:
        await _etcd_roundtrip(host, port)


async def test_mongo_replica_set(aiolease_server: GetServer) -> None:
    from pymongo import AsyncMongoClient

    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(
        aiolease_server("mongo"), serverSelectionTimeoutMS=5000
    )
    try:
        hello = await client.admin.command("hello")
        assert hello["isWritablePrimary"] and hello["setName"] == "rs0"
        coll = client.get_database("aiolease_test").get_collection(uuid.uuid4().hex)
        async with await coll.watch() as stream:
            await coll.insert_one({"_id": "x"})
            change = await stream.next()
        assert change["operationType"] == "insert"
        await coll.drop()
    finally:
        await client.close()


async def test_kafka_group_membership(aiolease_server: GetServer) -> None:
    from aiokafka import AIOKafkaConsumer

    host, port = _host_port(aiolease_server("kafka"))
    consumer = AIOKafkaConsumer(
        f"aiolease-test-{uuid.uuid4().hex}",
        bootstrap_servers=f"{host}:{port}",
        group_id=f"aiolease-test-{uuid.uuid4().hex}",
    )
    await consumer.start()
    try:
        await asyncio.wait_for(consumer.getmany(timeout_ms=100), timeout=30)
        assert consumer._coordinator is not None
        assert consumer._coordinator.member_id  # joined the group
    finally:
        await consumer.stop()


def test_zookeeper_ephemeral_node(aiolease_server: GetServer) -> None:
    from kazoo.client import KazooClient

    host, port = _host_port(aiolease_server("zookeeper"))
    client = KazooClient(hosts=f"{host}:{port}", timeout=5)
    client.start(timeout=10)
    try:
        path = client.create(f"/aiolease-test-{uuid.uuid4().hex}", b"v", ephemeral=True)
        data, stat = client.get(path)
        assert data == b"v" and stat.ephemeralOwner == client.client_id[0]
    finally:
        client.stop()
        client.close()


def test_zookeeper_ensemble_every_member(aiolease_server: GetServer) -> None:
    from kazoo.client import KazooClient

    aiolease_server("zookeeper-ensemble")
    for host, port in servers.server("zookeeper-ensemble").addresses:
        client = KazooClient(hosts=f"{host}:{port}", timeout=5)
        client.start(timeout=10)
        try:
            assert client.exists("/") is not None
        finally:
            client.stop()
            client.close()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"CI": "true"}, "failed"),
        ({"CI": "true", "AIOLEASE_ALLOW_SKIP": "1"}, "failed"),
        ({}, "failed"),
        ({"AIOLEASE_ALLOW_SKIP": "1"}, "skipped"),
    ],
    ids=["ci", "ci-ignores-opt-out", "local", "local-opt-out"],
)
def test_unreachable_server_fails_unless_opted_out_locally(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    expected: str,
) -> None:
    # A port nothing listens on: bind one, then close it.
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("AIOLEASE_ALLOW_SKIP", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AIOLEASE_REDIS_URL", f"redis://127.0.0.1:{port}/0")
    pytester.makepyfile(
        """
        def test_needs_redis(aiolease_server):
            aiolease_server("redis")
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(**{expected: 1})
    result.stdout.fnmatch_lines([f"*redis server at 127.0.0.1:{port} is unreachable*"])
