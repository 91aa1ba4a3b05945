"""Loss reasons say what happened, and a lost lease is reported at once: real servers
reached through a :class:`FaultProxy` that cuts the holder off.

* a server that stops answering (blackholed) or refuses the holder: ``UNREACHABLE``;
* a holder that did not send its renewal in time (its event loop stalled) while the
  server answered all along: ``EXPIRED``;
* with the server blackholed, ``LeaseLostError`` leaves the ``async with`` right after
  the body stops, not after the release of the lost lease timed out, and an
  elector's ``on_defeated`` is called before that release is awaited.

The other reasons need no fault: ``MAX_HOLD`` on real servers is in
``test_hold_limits.py``; ``UNHEALTHY``, ``RELEASED`` and ``SHUTDOWN`` are in
``tests/core``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import anyio
import pytest

import aiolease
from aiolease import AsyncLock, Elector, LeaseLostError, LossReason
from aiolease.abc import Backend
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.proxy import FaultProxy
from aiolease.testing.servers import server
from tests.backends.etcd.support import unique_prefix
from tests.backends.postgres.support import no_tls
from tests.backends.redis.support import prefix_fixture
from tests.support import unique, with_query

pytestmark = pytest.mark.anyio

TTL = 1.0
#: Far longer than any wait of these tests: what a release that cannot get through
#: would be waited for, were a lost lease's release not bounded by its margin.
RELEASE_TIMEOUT = 30.0
#: How long a lost lease may take to be reported once the body stopped: a tenth of
#: what waiting out the release would take, and many times what it takes here.
PROMPT = RELEASE_TIMEOUT / 10
#: Bound on each test's waits (the machine is shared and slow).
WAIT = 60.0

prefix = prefix_fixture("reasons")


Opener = Callable[[], AbstractAsyncContextManager[tuple[FaultProxy, Backend]]]


@pytest.fixture(params=["redis", "postgres", "etcd", "mongo", "zookeeper"])
def kind(request: pytest.FixtureRequest) -> str:
    """The server the holder is cut off from."""
    return str(request.param)


@pytest.fixture
def cut_off(
    kind: str, aiolease_server: Callable[[str], str], prefix: str, pg_schema: str
) -> Opener:
    """Opens a backend on ``kind``'s real server through a proxy of its own, whose
    requests the driver would wait for as long as the release timeout: only the core
    can give up on them sooner."""
    url = aiolease_server(kind)
    host, port = server(kind).addresses[0]

    @asynccontextmanager
    async def open_() -> AsyncIterator[tuple[FaultProxy, Backend]]:
        async with FaultProxy(host, port) as proxy:
            if kind == "redis":
                opened = aiolease.open_backend(
                    proxy.url_for(url), prefix=prefix, timeout=RELEASE_TIMEOUT
                )
            elif kind == "mongo":
                # One member, through the proxy: not the replica set's own addresses.
                direct = url.replace("replicaSet=rs0", "directConnection=true")
                opened = aiolease.open_backend(proxy.url_for(direct), collection=unique("reasons"))
            elif kind == "postgres":
                proxied = with_query(proxy.url_for(no_tls(url)), schema=pg_schema)
                opened = aiolease.open_backend(proxied, connect_timeout=RELEASE_TIMEOUT)
            elif kind == "zookeeper":
                # The session timeout as short as the server allows: the loss comes
                # when no request sent within it was answered.
                opened = aiolease.open_backend(
                    proxy.url_for(url),
                    prefix=unique_prefix(),
                    timeout=RELEASE_TIMEOUT,
                    session_timeout=TTL,
                )
            else:
                opened = aiolease.open_backend(
                    proxy.url_for(url), prefix=unique_prefix(), timeout=RELEASE_TIMEOUT
                )
            async with opened as backend:
                yield proxy, backend
                await proxy.pass_through()  # let the backend close cleanly

    return open_


async def lost_while_cut(
    backend: Backend, cut: Callable[[], Awaitable[None]], name: str
) -> tuple[LeaseLostError, float, float]:
    """Hold ``name``, cut the holder off with ``cut()`` and wait for the loss.

    :returns: the error, when the body stopped, and when the error came out
    """
    lock = AsyncLock(backend, name, ttl=TTL, release_timeout=RELEASE_TIMEOUT)
    stopped_at = -1.0
    with pytest.raises(LeaseLostError) as info, anyio.fail_after(WAIT):
        async with lock:
            await cut()
            try:
                await anyio.sleep_forever()
            finally:
                stopped_at = anyio.current_time()
    return info.value, stopped_at, anyio.current_time()


async def test_a_blackholed_server_is_unreachable(anyio_backend: str, cut_off: Opener) -> None:
    """Renewals sent and never answered: the backend could not be reached."""
    async with cut_off() as (proxy, backend):
        error, _, _ = await lost_while_cut(backend, proxy.blackhole, unique("blackholed"))
    assert error.reason is LossReason.UNREACHABLE


async def test_a_blackholed_server_reports_the_loss_at_once(
    anyio_backend: str, cut_off: Opener
) -> None:
    """The release of the lost lease cannot get through: the error must not wait for it."""
    async with cut_off() as (proxy, backend):
        _, stopped_at, surfaced_at = await lost_while_cut(
            backend, proxy.blackhole, unique("prompt")
        )
    assert surfaced_at - stopped_at < PROMPT


async def test_a_refused_holder_is_unreachable(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    host, port = server("redis").addresses[0]
    async with (
        FaultProxy(host, port) as proxy,
        aiolease.open_backend(proxy.url_for(redis_url), prefix=prefix) as backend,
    ):
        error, _, _ = await lost_while_cut(backend, proxy.reset, unique("refused"))
        await proxy.pass_through()
    assert error.reason is LossReason.UNREACHABLE


async def test_a_holder_that_stalls_past_its_deadline_expired(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """The server answers all along; the holder's event loop is stuck (a paused process)
    from before its first renewal until after its deadline: no renewal was sent."""
    async with aiolease.open_backend(redis_url, prefix=prefix) as backend:
        # Renewed late in its ttl: the first renewal is not due before the stall.
        lock = AsyncLock(backend, unique("stalled"), ttl=TTL, renew_interval=0.8 * TTL)
        with pytest.raises(LeaseLostError) as info, anyio.fail_after(WAIT):
            async with lock as lease:
                # Blocks the event loop on purpose: nothing of the holder's runs.
                time.sleep(lease.remaining + TTL / 2)  # noqa: ASYNC251
                await anyio.sleep_forever()
    assert info.value.reason is LossReason.EXPIRED


class Releases(FaultyBackend):
    """Counts releases that have returned (or were given up on)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.done = 0

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        try:
            return await super().release(name, owner, token)
        finally:
            self.done += 1

    def release_now(self, name: str, owner: str, token: int) -> Awaitable[bool] | None:
        sent = super().release_now(name, owner, token)
        return None if sent is None else self._counted(sent)

    async def _counted(self, sent: Awaitable[bool]) -> bool:
        """A release sent early (:meth:`Backend.release_now`), counted once it returned."""
        try:
            return await sent
        finally:
            self.done += 1


async def test_on_defeated_comes_before_the_release_of_the_lost_term(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    host, port = server("redis").addresses[0]
    async with (
        FaultProxy(host, port) as proxy,
        aiolease.open_backend(proxy.url_for(redis_url), prefix=prefix) as backend,
    ):
        releases = Releases(backend)
        defeated: list[tuple[LossReason, int]] = []
        elector = Elector(
            releases,
            unique("term"),
            ttl=TTL,
            release_timeout=RELEASE_TIMEOUT,
            on_defeated=lambda reason: defeated.append((reason, releases.done)),
        )
        with pytest.raises(LeaseLostError), anyio.fail_after(WAIT):
            async with elector.leadership():
                await proxy.blackhole()
                await anyio.sleep_forever()
        await proxy.pass_through()
    assert defeated == [(LossReason.UNREACHABLE, 0)]
    assert releases.done == 1


async def test_a_lease_nobody_renewed_expired_and_its_release_is_bounded(
    anyio_backend: str, cut_off: Opener
) -> None:
    """A lease from ``acquire()`` left alone: no renewal was sent, so ``EXPIRED``, even
    with the server cut off; releasing it then waits no longer than its margin."""
    async with cut_off() as (proxy, backend):
        lock = AsyncLock(backend, unique("alone"), ttl=TTL, release_timeout=RELEASE_TIMEOUT)
        lease = await lock.acquire()
        await proxy.blackhole()
        with anyio.fail_after(WAIT):
            assert await lease.wait_lost() is LossReason.EXPIRED
            asked_at = anyio.current_time()
            assert await lease.release() is False
        assert anyio.current_time() - asked_at < PROMPT
