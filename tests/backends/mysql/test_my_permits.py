"""MySQL/MariaDB's permits: the acquires and releases of one name that arrive while one
of the name's statements is in flight go together in the next (the batch procedure,
one transaction), in arrival order, and each gets the answer its own statement would
have given; a batch the server refuses is sent again one operation at a time."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncmy
import pytest

from aiolease import BackendError, LimitMismatchError
from aiolease.abc import Grant, HolderInfo, permit_owner
from aiolease.backends._asyncio import timeout_after
from aiolease.backends.mysql import MySQLBackend
from aiolease.backends.mysql._statements import ROWS, SETS, batch_ops
from aiolease.backends.sql._permits import permit_tables
from tests.backends.mysql.support import connect_args
from tests.support import on_asyncio, unique

pytestmark = pytest.mark.anyio


async def gathered(b: MySQLBackend, name: str, count: int) -> list[str]:
    """Until ``count`` operations of ``name`` wait behind the one in flight: their owners."""
    keys = b._permits.combiner._keys
    async with timeout_after(20):  # a hang guard
        while name not in keys or len(keys[name].waiting) < count:  # noqa: ASYNC110 - the combiner reports no event
            await asyncio.sleep(0.01)
    return [op[0] for op, _ in keys[name].waiting]


async def in_flight(b: MySQLBackend, name: str) -> None:
    """Until an operation of ``name`` is in flight (what is asked next gathers behind it)."""
    keys = b._permits.combiner._keys
    async with timeout_after(20):  # a hang guard
        while name not in keys or not keys[name].flying:  # noqa: ASYNC110 - the combiner reports no event
            await asyncio.sleep(0.01)


async def lock_row(blocker: Any, names: str, name: str) -> None:
    """Hold ``name``'s row of the ``names`` table in a transaction of ``blocker``'s (a
    raw connection), until its rollback: statements on the name wait on the server."""
    async with blocker.cursor() as cur:
        await cur.execute("START TRANSACTION")
        await cur.execute(f"SELECT 1 FROM {names} WHERE name = %s FOR UPDATE", (name,))


async def test_requests_that_arrive_together_go_as_one_statement_in_arrival_order(
    table_url: str, database: str, table: str
) -> None:
    names, permits = (f"`{database}`.`{t}`" for t in reversed(permit_tables(table, 64)))

    async def body() -> None:
        b = await MySQLBackend.from_url(table_url, poll_interval=60)
        blocker = await asyncmy.connect(**connect_args(table_url))
        try:
            name = unique("combined")
            holder = permit_owner()
            held = await b.try_acquire_permit(name, holder, 30, "h", {}, 1, 1)
            assert isinstance(held, Grant)
            # The name's row held by another transaction: the first ask waits on the
            # server, and the others gather behind it meanwhile.
            await lock_row(blocker, names, name)
            owners = [permit_owner() for _ in range(6)]
            asks = [
                asyncio.ensure_future(b.try_acquire_permit(name, o, 30, "w", {"o": o}, 1, 1))
                for o in owners
            ]
            arrived = await gathered(b, name, len(owners) - 1)
            await blocker.rollback()
            answers = await asyncio.gather(*asks)
            assert all(isinstance(a, HolderInfo) and a.owner == holder for a in answers)
            assert b.statistics().permit_statements_combined == 1
            async with blocker.cursor() as cur:
                await cur.execute(
                    f"SELECT owner FROM {permits} WHERE name = %s AND granted = 0 ORDER BY seq",
                    (name,),
                )
                queue = [row[0].decode() for row in await cur.fetchall()]
            assert queue[1:] == arrived and set(queue) == set(owners)
            # Releases and asks gathered behind a statement in flight: each release
            # grants the next in that order, once for the batch, and each ask, sent
            # after its release, finds its grant.
            await lock_row(blocker, names, name)
            first = asyncio.ensure_future(b.release(name, holder, held.token))
            await in_flight(b, name)  # the first release, which waits on the server
            later = [
                asyncio.ensure_future(b.try_acquire_permit(name, "permit:late", 30, "l", {}, 1, 1))
            ]
            await gathered(b, name, 1)
            await blocker.rollback()
            assert await first
            late = await later[0]
            assert isinstance(late, HolderInfo)  # behind the queue, in arrival order
            grant = await b.try_acquire_permit(name, queue[0], 30, "w", {}, 1, 1)
            assert isinstance(grant, Grant) and grant.token == held.token + 1
            releases = [(queue[0], grant.token)]
            for owner in [*queue[1:], "permit:late"]:
                who, token = releases.pop()
                release = asyncio.ensure_future(b.release(name, who, token))
                await asyncio.sleep(0)  # the release asks first: the ask goes after it
                grant = await b.try_acquire_permit(name, owner, 30, "w", {}, 1, 1)
                assert await release
                assert isinstance(grant, Grant) and grant.token == token + 1
                permits_now = await b.read_permits(name)
                assert permits_now is not None
                assert [h.owner for h in permits_now.holders] == [owner]
                releases.append((owner, grant.token))
            assert await b.release(name, *releases.pop())
            assert await b.read_permits(name) is None
        finally:
            blocker.close()
            await b.aclose()

    await on_asyncio(body)


async def test_a_request_the_server_refuses_fails_alone_in_a_batch(
    table_url: str, database: str, table: str
) -> None:
    names = f"`{database}`.`{permit_tables(table, 64)[1]}`"

    async def body() -> None:
        b = await MySQLBackend.from_url(table_url, poll_interval=60)
        blocker = await asyncmy.connect(**connect_args(table_url))
        try:
            name = unique("refused")
            holder = permit_owner()
            held = await b.try_acquire_permit(name, holder, 30, "h", {}, 2, 1)
            assert isinstance(held, Grant)
            await lock_row(blocker, names, name)
            first, bad, good = permit_owner(), permit_owner(), permit_owner()
            asks = [asyncio.ensure_future(b.try_acquire_permit(name, first, 30, "f", {}, 2, 1))]
            await in_flight(b, name)  # the first ask, which waits on the server
            # An identity longer than its column (1,024 bytes): the server refuses it.
            asks.append(
                asyncio.ensure_future(b.try_acquire_permit(name, bad, 30, "x" * 2000, {}, 2, 1))
            )
            asks.append(asyncio.ensure_future(b.try_acquire_permit(name, good, 30, "g", {}, 2, 1)))
            await gathered(b, name, 2)
            await blocker.rollback()
            answers = await asyncio.gather(*asks, return_exceptions=True)
            assert isinstance(answers[0], Grant)
            assert isinstance(answers[1], BackendError)
            assert isinstance(answers[2], HolderInfo)  # queued behind the two permits
            holders = await b.read_permits(name)
            assert holders is not None
            assert {h.owner for h in holders.holders} == {holder, first}
            assert holders.waiting == 1
        finally:
            blocker.close()
            await b.aclose()

    await on_asyncio(body)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def test_a_refusal_answers_the_permits_its_own_entry_and_the_first_other_entry(
    table_url: str, database: str, table: str
) -> None:
    """Routine version 7: a refusal (alone or in a batch) answers the live permits, the
    caller's entry and the first entry of another, not every queue entry (what Python
    reads: the blocker, and the places of the caller and of its blocker); a refusal in
    a batch leaves the name's token as it was."""
    names = f"`{database}`.`{permit_tables(table, 64)[1]}`"

    async def body() -> None:
        b = await MySQLBackend.from_url(table_url, poll_interval=60)
        reader = await asyncmy.connect(**connect_args(table_url))
        try:
            name = unique("answered")
            held = [permit_owner() for _ in range(2)]
            for owner in held:
                assert isinstance(await b.try_acquire_permit(name, owner, 30, "h", {}, 2, 1), Grant)
            queued = [permit_owner() for _ in range(4)]
            for owner in queued:
                refused = await b.try_acquire_permit(name, owner, 30, "q", {}, 2, 1)
                assert isinstance(refused, HolderInfo) and refused.owner in held
            permits = b._permits

            async def asked(owner: str) -> list[str]:
                params = {
                    "name": name.encode(),
                    "owner": owner.encode(),
                    "weight": 1,
                    "lim": 2,
                    "identity": b"n",
                    "metadata": b"{}",
                    "ttl": 30.0,
                    "us": 30_000_000,
                }
                rows = await permits._execute(permits._sql.acquire, params, ROWS)
                assert {_text(row[0]) for row in rows} <= {"queue", "refresh"}
                return [_text(row[2]) for row in rows]

            late = permit_owner()
            assert sorted(await asked(late)) == sorted([*held, queued[0], late])
            assert sorted(await asked(queued[2])) == sorted([*held, queued[0], queued[2]])
            assert sorted(await asked(queued[0])) == sorted([*held, queued[0], queued[1]])
            later = permit_owner()
            sets = await permits._execute(
                permits._sql.batch,
                {
                    "name": name.encode(),
                    "ops": batch_ops([(later, 1, 2, "n", "{}", 30.0), (queued[3], None)]),
                },
                SETS,
            )
            assert sorted(_text(row[2]) for row in sets[0]) == sorted([*held, queued[0], later])
            async with reader.cursor() as cur:
                await cur.execute(f"SELECT token FROM {names} WHERE name = %s", (name,))
                assert [row[0] for row in await cur.fetchall()] == [2]
            holders = await b.read_permits(name)
            assert holders is not None and holders.waiting == 5  # queued[3] left
        finally:
            reader.close()
            await b.aclose()

    await on_asyncio(body)


async def test_a_name_without_rows_is_granted_without_reading_them(
    table_url: str, database: str, table: str
) -> None:
    """Routine version 10: the acquire grants a name that has no row at all by one
    statement (the permit written only if no row of the name exists): the procedure
    runs one ``SELECT``, its answer, where it ran two (the read of the name's rows, and
    the answer). With a row of the name, it reads them as before, and grants by the
    rules (the next token, the limit checked)."""
    params = {"weight": 1, "lim": 2, "identity": b"n", "metadata": b"{}", "ttl": 30.0}
    params["us"] = 30_000_000
    permits_table = f"`{database}`.`{permit_tables(table, 64)[0]}`"

    async def body() -> None:
        b = await MySQLBackend.from_url(table_url, poll_interval=60)
        conn = await asyncmy.connect(**connect_args(table_url))
        try:
            await b.read_permits(unique("tables-made"))
            sql = b._permits._sql.acquire
            async with conn.cursor() as cur:
                await cur.execute(f"USE `{database}`")

            async def selects(name: str, owner: str) -> tuple[int, list[Any]]:
                async with conn.cursor() as cur:
                    await cur.execute("SHOW SESSION STATUS LIKE 'Com_select'")
                    (_, before) = await cur.fetchone()
                    await cur.execute(sql, {**params, "name": name.encode(), "owner": owner})
                    rows = list(await cur.fetchall())
                    while await cur.nextset():
                        pass
                    await cur.execute("SHOW SESSION STATUS LIKE 'Com_select'")
                    (_, after) = await cur.fetchone()
                return int(after) - int(before), rows

            name, first, second = unique("free"), permit_owner(), permit_owner()
            counted, rows = await selects(name, first)
            assert counted == 1
            assert [(_text(r[0]), r[1]) for r in rows] == [("grant", 1)]
            counted, rows = await selects(name, second)
            assert counted == 2
            assert [(_text(r[0]), r[1]) for r in rows] == [("grant", 2)]
            async with conn.cursor() as cur:
                await cur.execute(
                    f"SELECT owner, token FROM {permits_table} WHERE name = %s ORDER BY token",
                    (name,),
                )
                found = [(_text(r[0]), r[1]) for r in await cur.fetchall()]
            assert found == [(first, 1), (second, 2)]
            with pytest.raises(LimitMismatchError):
                await b.try_acquire_permit(name, permit_owner(), 30, "n", {}, 3, 1)
        finally:
            conn.close()
            await b.aclose()

    await on_asyncio(body)
