"""PostgreSQL's permits: the acquires and releases of one name that arrive while one of
the name's statements is in flight go together in the next (one transaction), in
arrival order, and each gets the answer its own statement would have given."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from aiolease.abc import Grant, HolderInfo, permit_owner
from aiolease.backends._asyncio import timeout_after
from aiolease.backends.postgres import PostgresBackend
from aiolease.backends.postgres._statements import permit_names_table, permits_table
from tests.support import on_asyncio, unique

pytestmark = pytest.mark.anyio


async def test_requests_that_arrive_together_go_as_one_statement_in_arrival_order(
    pg: str, schema: str, table_url: tuple[str, str]
) -> None:
    url, table = table_url
    names = f'"{schema}"."{permit_names_table(table)}"'
    permits = f'"{schema}"."{permits_table(table)}"'

    async def body() -> None:
        b = await PostgresBackend.from_url(url, poll_interval=60)
        blocker = await asyncpg.connect(pg)
        try:
            name = unique("combined")
            holder = permit_owner()
            held = await b.try_acquire_permit(name, holder, 30, "h", {}, 1, 1)
            assert isinstance(held, Grant)
            # The name's row held by another transaction: the first ask waits on the
            # server, and the others gather behind it meanwhile.
            lock = blocker.transaction()
            await lock.start()
            await blocker.execute(f"SELECT 1 FROM {names} WHERE name = $1 FOR UPDATE", name)
            owners = [permit_owner() for _ in range(6)]
            asks = [
                asyncio.ensure_future(b.try_acquire_permit(name, o, 30, "w", {"o": o}, 1, 1))
                for o in owners
            ]
            keys = b._permits.combiner._keys
            async with timeout_after(20):  # a hang guard
                while name not in keys or len(keys[name].waiting) < len(owners) - 1:  # noqa: ASYNC110 - the combiner reports no event
                    await asyncio.sleep(0.01)
            arrived = [op[0] for op, _ in keys[name].waiting]
            await lock.rollback()
            answers = await asyncio.gather(*asks)
            assert all(isinstance(a, HolderInfo) and a.owner == holder for a in answers)
            assert b.statistics().permit_statements_combined == 1
            queue = await blocker.fetch(
                f"SELECT owner FROM {permits} WHERE name = $1 AND NOT granted ORDER BY seq",
                name,
            )
            in_order = [row["owner"] for row in queue]
            assert in_order[1:] == arrived and set(in_order) == set(owners)
            # Each release grants the next in that order (its ask, sent after it, finds
            # the grant).
            releases = [(holder, held.token)]
            for owner in in_order:
                who, token = releases.pop()
                release = asyncio.ensure_future(b.release(name, who, token))
                await asyncio.sleep(0)  # the release asks first: the ask goes after it
                grant = await b.try_acquire_permit(name, owner, 30, "w", {}, 1, 1)
                assert await release
                assert isinstance(grant, Grant)
                permits_now = await b.read_permits(name)
                assert permits_now is not None
                assert [h.owner for h in permits_now.holders] == [owner]
                releases.append((owner, grant.token))
            assert await b.release(name, *releases.pop())
            assert await b.read_permits(name) is None
        finally:
            await blocker.close()
            await b.aclose()

    await on_asyncio(body)


async def test_a_refusal_answers_the_blocker_only_and_writes_no_other_row(
    pg: str, schema: str, table_url: tuple[str, str]
) -> None:
    """A refused ask reads the name's rows without locking them (the row lock of each
    wrote its tuple, and WAL), answers one row, the blocker, and a retry of a queued
    request writes neither the name's row nor another's."""
    url, table = table_url
    names = f'"{schema}"."{permit_names_table(table)}"'
    permits = f'"{schema}"."{permits_table(table)}"'

    async def body() -> None:
        b = await PostgresBackend.from_url(url, poll_interval=60, listen=False)
        conn = await asyncpg.connect(pg)
        try:
            name = unique("refusal")
            holders = [permit_owner() for _ in range(2)]
            for ttl, owner in zip((30, 20), holders, strict=True):
                assert isinstance(
                    await b.try_acquire_permit(name, owner, ttl, "h", {}, 2, 1), Grant
                )
            queued = [permit_owner() for _ in range(3)]
            for owner in queued:
                assert isinstance(
                    await b.try_acquire_permit(name, owner, 30, "w", {}, 2, 1), HolderInfo
                )

            async def versions() -> dict[str, tuple[str, str]]:
                rows = await conn.fetch(
                    f"SELECT owner, xmin::text AS xmin, xmax::text AS xmax FROM {permits}"
                    f" WHERE name = $1 UNION ALL SELECT '', xmin::text, '' FROM {names}"
                    " WHERE name = $1",
                    name,
                )
                return {row["owner"]: (row["xmin"], row["xmax"]) for row in rows}

            # The routine's answer to a new request: the permit that expires first.
            newcomer = permit_owner()
            before = await versions()
            answer = await conn.fetch(
                b._permits._sql.acquire, name, newcomer, 1, 2, "n", "{}", 30.0
            )
            assert [(row["act"], row["owner"]) for row in answer] == [("queue", holders[1])]
            after = await versions()
            assert {o: v for o, v in after.items() if o not in (newcomer, "")} == {
                o: v for o, v in before.items() if o != ""
            }
            # A retry of a queued request (its place kept): the name's row and the
            # others' as they were.
            before = after
            refused = await b.try_acquire_permit(name, queued[1], 30, "w", {}, 2, 1)
            assert isinstance(refused, HolderInfo) and refused.owner == holders[1]
            after = await versions()
            assert {o: v for o, v in after.items() if o != queued[1]} == {
                o: v for o, v in before.items() if o != queued[1]
            }
            # Only the queue blocks: the first entry ahead, with token 0.
            for owner in holders:
                await conn.execute(
                    f"DELETE FROM {permits} WHERE name = $1 AND owner = $2", name, owner
                )
            await conn.execute(
                f"UPDATE {permits} SET weight = 2 WHERE name = $1 AND owner = $2", name, queued[0]
            )
            blocked = await b.try_acquire_permit(name, queued[2], 30, "w", {}, 2, 1)
            assert isinstance(blocked, HolderInfo)
            assert (blocked.owner, blocked.token) == (queued[0], 0)
        finally:
            await conn.close()
            await b.aclose()

    await on_asyncio(body)


async def test_a_grant_to_a_waiter_of_the_releasing_backend_is_not_notified(
    pg: str, schema: str, table_url: tuple[str, str]
) -> None:
    """A release hands a waiter queued through its own backend object its grant in the
    answer: no ``NOTIFY`` for it (its listener would only drop it); a waiter queued
    through another backend object is told."""
    url, _table = table_url

    async def body() -> None:
        a = await PostgresBackend.from_url(url, poll_interval=60, listen=False)
        b = await PostgresBackend.from_url(url, poll_interval=60, listen=False)
        heard: asyncio.Queue[str] = asyncio.Queue()
        conn = await asyncpg.connect(pg)
        try:
            await conn.add_listener(a.channel, lambda *args: heard.put_nowait(args[-1]))
            name = unique("told")
            holder, here, there = permit_owner(), permit_owner(), permit_owner()
            held = await a.try_acquire_permit(name, holder, 30, "h", {}, 1, 1)
            assert isinstance(held, Grant)
            assert isinstance(await a.try_acquire_permit(name, here, 30, "w", {}, 1, 1), HolderInfo)
            assert isinstance(
                await b.try_acquire_permit(name, there, 30, "w", {}, 1, 1), HolderInfo
            )
            assert await a.release(name, holder, held.token)  # grants ``here``, a's own
            turn = await a.try_acquire_permit(name, here, 30, "w", {}, 1, 1)
            assert isinstance(turn, Grant)
            assert await a.release(name, here, turn.token)  # grants ``there``, b's
            # Notifications come in commit order: once ``there``'s is heard, one for
            # ``here`` would have come before it.
            payloads: list[str] = []
            async with timeout_after(20):  # a hang guard
                while not any(there in p for p in payloads):
                    payloads.append(await heard.get())
            assert [p for p in payloads if p.startswith("q")] == [f"q{len(there)}:{there}{name}"]
        finally:
            await conn.close()
            await a.aclose()
            await b.aclose()

    await on_asyncio(body)


async def test_the_routines_read_a_busy_name_s_rows_by_plain_index_scans(
    pg: str, table_url: tuple[str, str]
) -> None:
    """A permit row is written per request and deleted at its release, so a busy name
    leaves dead rows until a vacuum (the test server runs none). The routines read a
    name's rows by plain index scans, which mark dead entries and skip them after: the
    plans of every statement they run on the permits table, as ``auto_explain`` reports
    them, after 1,500 permits of the name. (The planner chose a bitmap scan before,
    which visited every dead row of the name again on every read: each statement of a
    busy name cost more and more. Buffers touched were compared here first; under
    load, another session's snapshot keeps dead entries from being marked, so they
    varied.)"""
    url, table = table_url
    permits = permits_table(table)

    async def body() -> None:
        b = await PostgresBackend.from_url(url, poll_interval=60, listen=False)
        conn = await asyncpg.connect(pg)
        plans: list[str] = []
        conn.add_log_listener(lambda _, message: plans.append(message.message))
        sql = b._permits._sql
        try:
            name = unique("busy")
            for _ in range(1500):
                owner = permit_owner()
                grant = await b.try_acquire_permit(name, owner, 30, "h", {"k": "v"}, 4, 1)
                assert isinstance(grant, Grant)
                assert await b.release(name, owner, grant.token)
            for setting in (
                "LOAD 'auto_explain'",
                "SET auto_explain.log_min_duration = 0",
                "SET auto_explain.log_nested_statements = on",
                "SET auto_explain.log_level = notice",
            ):
                await conn.execute(setting)
            # Another holder: the acquire reads the name's rows (a name with none is
            # granted without a read), and so does the release.
            other = permit_owner()
            held = await b.try_acquire_permit(name, other, 30, "h", {}, 4, 1)
            assert isinstance(held, Grant)
            owner = permit_owner()
            (row,) = await conn.fetch(sql.acquire, name, owner, 1, 4, "h", "{}", 30.0)
            assert row["act"] == "grant"
            await conn.fetch(sql.release, name, owner, row["tok"], "c", [])
            await conn.fetch(
                sql.batch,
                name,
                "ar",
                [permit_owner(), other],
                [None, held.token],
                [1, None],
                [4, None],
                ["h", None],
                ["{}", None],
                [30.0, None],
                "c",
                [],
            )
            # The scan nodes on the permits table of every statement the routines ran
            # (the plan lines, not the query's text).
            scans = [
                line.strip(" ->")
                for plan in plans
                for line in plan.partition("\n")[2].splitlines()
                if "Scan" in line
                and f" on {permits} " in f"{line} "
                and not line.startswith("Query Text")
            ]
            assert len(scans) >= 6, plans
            assert all(scan.startswith("Index Scan") for scan in scans), scans
        finally:
            await conn.close()
            await b.aclose()

    await on_asyncio(body)
