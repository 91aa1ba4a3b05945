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
