"""Batched renewals in the SQL backends, on the real servers: what the backend keeps of
each grant (to answer ``read`` and refuse local contenders without a statement) follows
the batch's statements without an update per grant per tick."""

from __future__ import annotations

from typing import Any

import pytest

import aiolease
from aiolease._checked import HeldRenewals
from aiolease.abc import Grant
from tests.backends.mysql.support import in_database
from tests.support import unique, with_query

pytestmark = pytest.mark.anyio

TTL = 30.0


@pytest.fixture(params=["postgres", "mariadb"])
def url(request: pytest.FixtureRequest) -> str:
    table = unique("renewals")
    if request.param == "postgres":
        pg, schema = request.getfixturevalue("pg"), request.getfixturevalue("pg_schema")
        return with_query(pg, schema=schema, table=table)
    my = in_database(request.getfixturevalue("my"), request.getfixturevalue("my_database"))
    return with_query(my, table=table)


async def test_a_batch_renewal_moves_every_grant_it_renews_and_no_other(url: str) -> None:
    async with aiolease.open_backend(url) as backend:
        inner: Any = getattr(backend, "inner", backend)  # (under trio, the bridge's)
        held: dict[str, Any] = inner._held
        a, b = unique("a"), unique("b")
        granted = {}
        for name in (a, b):
            result = await backend.try_acquire(name, f"owner-{name}", TTL, "me", {})
            assert isinstance(result, Grant)
            granted[name] = result
        renewals = HeldRenewals()
        renewals.extend((n, f"owner-{n}", granted[n].token, TTL) for n in (a, b))
        confirmed = []
        for _ in range(3):  # tick after tick, the same list (as the core's cohorts)
            results = list(await backend.renew_many(renewals))
            assert all(isinstance(r, Grant) for r in results)
            sent = {held[n].sent_at for n in (a, b)}
            assert len(sent) == 1  # one statement renewed both
            confirmed.append(sent.pop())
        assert confirmed == sorted(set(confirmed))  # each tick's statement is newer
        holder = await backend.read(a)
        assert holder is not None and holder.remaining is not None
        assert 0 < holder.remaining <= TTL

        # A renewal of one of them with a shorter ttl, alone: from then on the batch's
        # statements (which ask the longer ttl) no longer speak for what it knows.
        assert await backend.renew(a, f"owner-{a}", granted[a].token, 5.0)
        assert held[a].ttl == 5.0
        alone = held[a].sent_at
        await backend.renew_many(renewals)
        assert held[a].sent_at == alone and held[b].sent_at > alone
        holder = await backend.read(a)
        assert holder is not None and holder.remaining is not None
        assert holder.remaining <= TTL

        # A grant that a batch did not renew is forgotten, and the others still move.
        assert await backend.release(b, f"owner-{b}", granted[b].token)
        results = list(await backend.renew_many(renewals))
        assert isinstance(results[0], Grant) and isinstance(results[1], aiolease.NotOwnerError)
        assert b not in held
