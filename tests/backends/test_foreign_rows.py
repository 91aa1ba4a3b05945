"""Rows and keys that aiolease did not write, in the SQL backends' tables, under
etcd's prefix, MongoDB's collection and ZooKeeper's prefix node: a typed
ForeignDataError naming them, never a driver's or ``json``'s exception, never a
silent overwrite, and the row left as it was.

Each case writes the row behind the backend's back (on a connection of its own, in a
table or prefix of the test's own), then reads it, acquires it without waiting and
waiting, through the backend, on the real server, under asyncio and trio.
"""

from __future__ import annotations

import base64
import re
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio.to_thread
import pytest

import aiolease
from aiolease import AsyncLock, ForeignDataError
from aiolease.backends.sqlite import host_boot_id
from aiolease.backends.zookeeper._nodes import Layout
from tests.backends.etcd.support import Gateway, unique_prefix
from tests.backends.mongo.support import raw as mongo_raw
from tests.backends.mysql.support import raw as my_raw
from tests.backends.postgres.support import no_tls
from tests.backends.postgres.support import raw as pg_raw
from tests.backends.zookeeper.support import Outside
from tests.backends.zookeeper.support import unique_prefix as zk_prefix
from tests.support import unique, with_query

pytestmark = pytest.mark.anyio

#: Stands for "an hour from now, on the server's clock" in a case's expiry.
HOUR = "hour"


@dataclass(frozen=True)
class Row:
    """A held row, as another program might write it (by default one aiolease could have
    written: each case changes what makes it foreign)."""

    owner: str | bytes | None = "someone-else"
    identity: str = "them"
    token: object = 7
    metadata: str = "{}"
    expires: object = HOUR


@dataclass
class Place:
    """Where one backend keeps its leases, and raw access to them behind its back."""

    url: str
    #: Writes row ``name``.
    write: Callable[[str, Row], Awaitable[None]]
    #: Row ``name`` as stored (to tell that nothing changed it).
    look: Callable[[str], Awaitable[Any]]
    options: dict[str, Any] = field(default_factory=dict)


def foreign(name: str) -> pytest.RaisesGroup[Any]:
    """Expects a ForeignDataError about ``name``, whose message names it (seen through
    the exception group that a trio-asyncio loop may wrap it in)."""
    return pytest.RaisesGroup(
        pytest.RaisesExc(
            ForeignDataError, match=re.escape(repr(name)), check=lambda e: e.name == name
        ),
        allow_unwrapped=True,
        flatten_subgroups=True,
    )


async def check_foreign(place: Place, row: Row) -> None:
    """Row ``row`` is reported as foreign by read, acquire_nowait and acquire, and left
    as it was."""
    name = unique("foreign")
    async with aiolease.open_backend(place.url, **place.options) as backend:
        assert await backend.read(unique("other")) is None  # the table exists now
        await place.write(name, row)
        before = await place.look(name)
        with foreign(name):
            await backend.read(name)
        lock = AsyncLock(backend, name, ttl=10)
        with foreign(name):
            await lock.acquire_nowait()
        with foreign(name):
            await lock.acquire(timeout=5)
        assert await place.look(name) == before


# -- PostgreSQL --------------------------------------------------------------------------------


@pytest.fixture
def pg_place(aiolease_server: Callable[[str], str], pg_schema: str) -> Place:
    url = no_tls(aiolease_server("postgres"))
    table = unique("leases")
    where = f'"{pg_schema}"."{table}"'

    async def write(name: str, row: Row) -> None:
        expires = "now() + interval '1 hour'" if row.expires == HOUR else "NULL"
        await pg_raw(
            url,
            f"INSERT INTO {where} (name, token, owner, identity, metadata, ttl, acquired_at,"
            f" expires_at) VALUES ($1, $2, $3, $4, $5, 30, now(), {expires})",
            name,
            row.token,
            row.owner,
            row.identity,
            row.metadata,
        )

    async def look(name: str) -> Any:
        # Not the marks (queued_until, watched_until): aiolease's own bookkeeping.
        return await pg_raw(
            url,
            "SELECT name, token, owner, identity, metadata, ttl, acquired_at, expires_at"
            f" FROM {where} WHERE name = $1",
            name,
        )

    return Place(with_query(url, schema=pg_schema, table=table), write, look)


PG_CASES = {
    "metadata-not-json": Row(metadata="not json"),
    "metadata-a-list": Row(metadata="[1,2]"),
    "metadata-a-number": Row(metadata="5"),
    "metadata-not-strings": Row(metadata='{"a": 1}'),
    "held-with-no-expiry": Row(expires=None),
}


@pytest.mark.parametrize("row", PG_CASES.values(), ids=PG_CASES.keys())
async def test_postgres(pg_place: Place, row: Row) -> None:
    await check_foreign(pg_place, row)


async def test_postgres_waiting_reads_report_a_row_held_forever(pg_place: Place) -> None:
    # wait_changed marks the row watched and reads it in one statement.
    name = unique("foreign")
    async with aiolease.open_backend(pg_place.url) as backend:
        assert await backend.read(name) is None
        await pg_place.write(name, Row(expires=None))
        with foreign(name):
            await backend.wait_changed(name, None)


# -- MySQL / MariaDB ---------------------------------------------------------------------------


@pytest.fixture
def my_place(aiolease_server: Callable[[str], str], my_database: str) -> Place:
    url = aiolease_server("mariadb")
    table = unique("leases")
    where = f"`{my_database}`.`{table}`"

    async def write(name: str, row: Row) -> None:
        expires = "UTC_TIMESTAMP(6) + INTERVAL 1 HOUR" if row.expires == HOUR else "NULL"
        owner = row.owner.encode() if isinstance(row.owner, str) else row.owner
        await my_raw(
            url,
            f"INSERT INTO {where} (name, token, owner, identity, metadata, ttl, acquired_at,"
            f" expires_at) VALUES (%s, %s, %s, %s, %s, 30, UTC_TIMESTAMP(6), {expires})",
            name.encode(),
            row.token,
            owner,
            row.identity.encode(),
            row.metadata.encode(),
        )

    async def look(name: str) -> Any:
        return await my_raw(
            url,
            "SELECT name, token, owner, identity, metadata, ttl, acquired_at, expires_at"
            f" FROM {where} WHERE name = %s",
            name.encode(),
        )

    in_database = urlunsplit(urlsplit(url)._replace(path=f"/{my_database}"))
    return Place(with_query(in_database, table=table), write, look)


MY_CASES = {
    "metadata-not-json": Row(metadata="not json"),
    "metadata-a-list": Row(metadata="[1,2]"),
    "owner-not-utf8": Row(owner=b"\xff\xfe-owner"),
    "held-with-no-expiry": Row(expires=None),
}


@pytest.mark.parametrize("row", MY_CASES.values(), ids=MY_CASES.keys())
async def test_mysql(my_place: Place, row: Row) -> None:
    await check_foreign(my_place, row)


# -- SQLite ------------------------------------------------------------------------------------


@pytest.fixture
def sqlite_place(tmp_path: Path) -> Place:
    path = tmp_path / "leases.db"

    def run(sql: str, *args: object) -> list[Any]:
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            return conn.execute(sql, args).fetchall()
        finally:
            conn.close()

    async def write(name: str, row: Row) -> None:
        # The backend's clock is the host's monotonic clock, and rows carry the boot id.
        expires = time.monotonic() + 3600 if row.expires == HOUR else row.expires
        await anyio.to_thread.run_sync(
            lambda: run(
                "INSERT INTO aiolease_leases (name, token, owner, identity, metadata, ttl,"
                " expires_at, boot_id) VALUES (?, ?, ?, ?, ?, 3600, ?, ?)",
                name,
                row.token,
                row.owner,
                row.identity,
                row.metadata,
                expires,
                host_boot_id(),
            )
        )

    async def look(name: str) -> Any:
        return await anyio.to_thread.run_sync(
            lambda: run("SELECT *, typeof(token) FROM aiolease_leases WHERE name = ?", name)
        )

    return Place(f"sqlite:///{path}", write, look)


SQLITE_CASES = {
    "metadata-not-json": Row(metadata="not json"),
    "metadata-a-list": Row(metadata="[1,2]"),
    "metadata-a-number": Row(metadata="5"),
    "expiry-as-text": Row(expires="soon"),
    "held-with-no-expiry": Row(expires=None),
    "token-as-text": Row(token="seven"),
}


@pytest.mark.parametrize("row", SQLITE_CASES.values(), ids=SQLITE_CASES.keys())
async def test_sqlite(sqlite_place: Place, row: Row) -> None:
    await check_foreign(sqlite_place, row)


async def test_sqlite_free_row_with_a_text_token_is_not_replaced(sqlite_place: Place) -> None:
    # Released (no owner), but its token is text: a grant would restart tokens at 1.
    await check_foreign(sqlite_place, Row(owner=None, token="seven", expires=None))


# -- etcd --------------------------------------------------------------------------------------


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@pytest.fixture(params=[False, True], ids=["plain", "fair"])
def etcd_place(request: pytest.FixtureRequest, aiolease_server: Callable[[str], str]) -> Place:
    url = aiolease_server("etcd")
    prefix = unique_prefix()
    gateway = Gateway(url)

    async def write(name: str, row: Row) -> None:
        assert isinstance(row.owner, str)
        key = f"{prefix}{name}/{row.owner}".encode()
        await gateway.post("/v3/kv/put", {"key": _b64(key), "value": _b64(row.metadata.encode())})

    async def look(name: str) -> Any:
        return await gateway.keys(f"{prefix}{name}/")

    return Place(url, write, look, {"prefix": prefix, "fair": request.param})


# For etcd the whole value is the row: ``metadata`` here is the value written.
ETCD_CASES = {
    "not-json": Row(metadata="not json"),
    "empty": Row(metadata=""),
    "a-list": Row(metadata="[1,2]"),
    "no-metadata": Row(metadata='{"identity": "them"}'),
    "metadata-not-strings": Row(metadata='{"identity": "them", "metadata": {"a": 1}}'),
    "identity-a-number": Row(metadata='{"identity": 5, "metadata": {}}'),
}


@pytest.mark.parametrize("row", ETCD_CASES.values(), ids=ETCD_CASES.keys())
async def test_etcd(etcd_place: Place, row: Row) -> None:
    await check_foreign(etcd_place, row)


# -- MongoDB -----------------------------------------------------------------------------------


@pytest.fixture(params=[False, True], ids=["plain", "fair"])
def mongo_place(
    request: pytest.FixtureRequest, aiolease_server: Callable[[str], str]
) -> Iterator[Place]:
    url = aiolease_server("mongo")
    collection = unique("leases")

    def on(client: Any) -> Any:
        return client.aiolease[collection]

    def put(doc: dict[str, Any]) -> None:
        with mongo_raw(url) as client:
            on(client).insert_one(doc)

    def get(name: str) -> Any:
        with mongo_raw(url) as client:
            return on(client).find_one({"_id": name})

    async def write(name: str, row: Row) -> None:
        doc: dict[str, Any] = {"_id": name, "token": row.token, "owner": row.owner}
        doc |= {"identity": row.identity, "ttl": 30.0}
        doc["metadata"] = row.metadata if not isinstance(row.metadata, str) else {}
        if row.expires == HOUR:
            doc["expires"] = datetime.now(timezone.utc) + timedelta(hours=1)
        elif row.expires is not None:
            doc["expires"] = row.expires
        await anyio.to_thread.run_sync(put, {**doc, **MONGO_EXTRA.get(row, {})})

    async def look(name: str) -> Any:
        return await anyio.to_thread.run_sync(get, name)

    yield Place(url, write, look, {"collection": collection, "fair": request.param})
    with mongo_raw(url) as client:
        client.aiolease.drop_collection(collection)


#: What a case writes beyond the fields of ``Row`` (values of other types than Row's).
MONGO_EXTRA: dict[Row, dict[str, Any]] = {}


def _mongo_case(row: Row, **extra: Any) -> Row:
    MONGO_EXTRA[row] = extra
    return row


MONGO_CASES = {
    "token-a-string": _mongo_case(Row(token="7")),
    "token-zero": _mongo_case(Row(token=0)),
    "no-token": _mongo_case(Row(), token=None),
    "owner-a-number": _mongo_case(Row(owner="x", identity="n"), owner=5),
    "owner-empty": _mongo_case(Row(owner="", identity="e")),
    "identity-a-number": _mongo_case(Row(identity="num"), identity=5),
    "metadata-a-list": _mongo_case(Row(metadata="list"), metadata=[1, 2]),
    "metadata-not-strings": _mongo_case(Row(metadata="ns"), metadata={"a": 1}),
    "held-with-no-expiry": _mongo_case(Row(expires=None)),
    "expiry-a-string": _mongo_case(Row(expires="tomorrow")),
    "queue-not-an-array": _mongo_case(Row(identity="q"), queue="x"),
    # Released (no owner), but its token is text: a grant would restart tokens at 1.
    "free-with-a-text-token": _mongo_case(Row(owner=None, token="seven", expires=None)),
}


@pytest.mark.parametrize("row", MONGO_CASES.values(), ids=MONGO_CASES.keys())
async def test_mongo(mongo_place: Place, row: Row) -> None:
    await check_foreign(mongo_place, row)


# -- ZooKeeper ---------------------------------------------------------------------------------


@pytest.fixture
def zk_place(aiolease_server: Callable[[str], str]) -> Place:
    url = aiolease_server("zookeeper")
    prefix = zk_prefix()

    def node_of(name: str) -> str:
        return Layout(f"/{prefix}").name_node(name)

    async def write(name: str, row: Row) -> None:
        assert isinstance(row.owner, str)
        async with Outside(url) as outside:
            path = f"{node_of(name)}/{row.owner}"
            await outside.call("create", path, row.metadata.encode(), makepath=True)

    async def look(name: str) -> Any:
        async with Outside(url) as outside:
            nodes = sorted(await outside.children(node_of(name)))
            return [(n, (await outside.call("get", f"{node_of(name)}/{n}"))[0]) for n in nodes]

    return Place(url, write, look, {"prefix": prefix})


#: ``owner`` is the node's name under the name's node, ``metadata`` its data.
_OURS = "_c_someone-lock-0000000000"
ZK_CASES = {
    "a-foreign-node-name": Row(owner="someone-else", metadata='{"i": "them", "m": {}}'),
    "no-sequence": Row(owner="_c_someone-lock-", metadata='{"i": "them", "m": {}}'),
    "not-json": Row(owner=_OURS, metadata="not json"),
    "empty": Row(owner=_OURS, metadata=""),
    "a-list": Row(owner=_OURS, metadata="[1,2]"),
    "metadata-not-strings": Row(owner=_OURS, metadata='{"i": "them", "m": {"a": 1}}'),
    "identity-a-number": Row(owner=_OURS, metadata='{"i": 5, "m": {}}'),
}


@pytest.mark.parametrize("row", ZK_CASES.values(), ids=ZK_CASES.keys())
async def test_zookeeper(zk_place: Place, row: Row) -> None:
    await check_foreign(zk_place, row)
