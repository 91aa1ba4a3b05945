"""``min_hold`` and ``max_hold`` on real servers: a job's name is kept on the server after
the job ended early, by a renewal with the time left as its ttl (the contract's renew
with a ttl of the caller's choosing), and then given to the next machine; a term limit
releases the name on the server. Two backend objects stand for two machines."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import pytest

import aiolease
from aiolease import AsyncLock, LeaseHeldError, LeaseLostError, LossReason
from aiolease.abc import Backend
from tests.backends.redis.support import prefix_fixture
from tests.support import unique, with_query

pytestmark = pytest.mark.anyio

WAIT = 30.0
#: Far longer than the test: only min_hold can free the name in time.
TTL = 60.0
MIN_HOLD = 0.5

prefix = prefix_fixture("holds")

Machines = Callable[[], AbstractAsyncContextManager[tuple[Backend, Backend]]]


@pytest.fixture(params=["redis", "postgres"])
def machines(
    request: pytest.FixtureRequest, redis_url: str, prefix: str, pg: str, pg_schema: str
) -> Machines:
    """Opens two backends on one real server (keys and tables of the test's own)."""
    options: dict[str, Any] = {}
    if request.param == "redis":
        url, options["prefix"] = redis_url, prefix
    else:
        url = with_query(pg, schema=pg_schema)

    @asynccontextmanager
    async def open_() -> AsyncIterator[tuple[Backend, Backend]]:
        async with AsyncExitStack() as stack:
            a = await stack.enter_async_context(aiolease.open_backend(url, **options))
            b = await stack.enter_async_context(aiolease.open_backend(url, **options))
            yield a, b

    return open_


async def test_min_hold_keeps_the_name_on_the_server_then_frees_it(
    anyio_backend: str, machines: Machines
) -> None:
    name = unique("nightly")
    async with machines() as (a, b):
        async with AsyncLock(a, name, ttl=TTL, min_hold=MIN_HOLD) as ran:
            pass  # the job ended at once
        holder = await b.read(name)
        assert holder is not None and holder.owner == ran.owner
        # The server keeps it for what is left of min_hold, not for the lock's ttl.
        assert holder.remaining is not None and holder.remaining <= MIN_HOLD
        other = AsyncLock(b, name, ttl=TTL)
        with pytest.raises(LeaseHeldError):
            await other.acquire_nowait()
        with anyio.fail_after(WAIT):
            async with other.hold() as next_run:
                assert next_run.token > ran.token


async def test_max_hold_releases_the_name_on_the_server(
    anyio_backend: str, machines: Machines
) -> None:
    name = unique("term")
    async with machines() as (a, b):
        with pytest.raises(LeaseLostError) as info, anyio.fail_after(WAIT):
            async with AsyncLock(a, name, ttl=TTL, max_hold=0.2):
                await anyio.sleep_forever()
        assert info.value.reason is LossReason.MAX_HOLD
        assert await b.read(name) is None
