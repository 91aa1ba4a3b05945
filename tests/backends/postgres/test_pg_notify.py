"""PostgreSQL's LISTEN/NOTIFY: who is woken by which notification, which rows are
watched (so that grants and releases nobody queued for are announced), and the
fallback when the listener connection is lost or cannot connect."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import aiolease
from aiolease import (
    AsyncLock,
    Capability,
    LeaseLostError,
    LossReason,
)
from aiolease.backends._asyncio import now
from aiolease.backends.postgres import PostgresBackend
from aiolease.backends.postgres._queue import Queue
from aiolease.backends.postgres._statements import grants_channel, parse_notice, parse_payload
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.proxy import FaultProxy
from aiolease.testing.servers import server
from tests.backends.postgres.support import (
    changed,
    raw,
    waiting,
)
from tests.backends.sql.support import (
    check_oldest_waiter_gets_it,
)
from tests.support import eventually, grant, inner, unique, with_query

pytestmark = pytest.mark.anyio


backend = aiolease.open_backend


async def test_notify_wakes_a_waiter_of_another_backend(pg_url: str) -> None:
    # With no polling and a long ttl, only a NOTIFY can wake the waiter in time.
    async with backend(pg_url, poll_interval=60) as waiter, backend(pg_url) as holder_side:
        name = unique("notify")
        granted = await grant(holder_side, name, "owner-1", ttl=60)
        seen = await waiter.read(name)
        async with changed(waiter, name, seen):
            assert inner(waiter, PostgresBackend).statistics().listening
            assert await holder_side.release(name, "owner-1", granted.token)


async def test_notify_on_takeover_wakes_the_old_holders_watch(
    pg: str, pg_url: str, schema: str
) -> None:
    async with backend(pg_url, poll_interval=60) as waiter, backend(pg_url) as other:
        name = unique("takeover")
        await grant(other, name, "owner-1", ttl=60)
        seen = await waiter.read(name)
        async with changed(waiter, name, seen):
            await raw(
                pg,
                f'UPDATE "{schema}".aiolease_leases'
                " SET expires_at = clock_timestamp() WHERE name = $1",
                name,
            )
            await grant(other, name, "owner-2")  # takes over the expired row: NOTIFY


@pytest.mark.parametrize("free", ["never held", "released"])
async def test_notify_of_a_grant_wakes_a_wait_for_a_holder_to_appear(
    pg_url: str, free: str
) -> None:
    # Grants of a free name go to the grants channel, which a wait for a holder listens to.
    async with backend(pg_url, poll_interval=60) as watcher, backend(pg_url) as other:
        name = unique("appear")
        if free == "released":
            granted = await grant(other, name, "owner-0", ttl=60)
            assert await other.release(name, "owner-0", granted.token)
        async with changed(watcher, name, None):
            await grant(other, name, "owner-1", ttl=60)
        holder = await watcher.read(name)
        assert holder is not None and holder.owner == "owner-1"


async def test_holders_do_not_hear_grants_and_releases_nobody_waits_for(pg_url: str) -> None:
    async with backend(pg_url) as b, backend(pg_url) as other:
        pg_b = inner(b, PostgresBackend)
        async with AsyncLock(b, unique("held"), ttl=60):  # connects the listener
            assert pg_b.statistics().listening
            heard = pg_b._listener.notes
            for i in range(3):  # each a grant of a free name, then its release
                name = unique(f"free-{i}")
                granted = await grant(other, name, "owner-1", ttl=60)
                assert await other.release(name, "owner-1", granted.token)
            # A release in the name of a grant made elsewhere is announced to holders:
            # once it arrives, anything committed before it has arrived too.
            name = unique("elsewhere")
            granted = await grant(other, name, "owner-2", ttl=60)
            assert await b.release(name, "owner-2", granted.token)
            await _heard_more_than(pg_b, heard)
            assert pg_b._listener.notes == heard + 1  # ... and none of the grants and releases


async def test_grants_and_releases_of_rows_nobody_watches_are_not_announced(
    pg_url: str,
) -> None:
    # A wait for a holder to appear marks its row watched; other rows' grants of a free
    # name and releases nobody queued for send no notification at all.
    async with backend(pg_url, poll_interval=60) as watcher, backend(pg_url) as other:
        pg_watcher = inner(watcher, PostgresBackend)
        watched = unique("watched")
        async with changed(watcher, watched, None):
            heard = pg_watcher._listener.notes
            for i in range(3):  # grants of free names nobody watches, and their releases
                name = unique(f"unwatched-{i}")
                granted = await grant(other, name, "owner-1", ttl=60)
                assert await other.release(name, "owner-1", granted.token)
            # The watched row's grant is announced; notifications come in commit order,
            # so any of the others would have come before it.
            first = await grant(other, watched, "owner-2", ttl=60)
        await _heard_more_than(pg_watcher, heard)
        assert pg_watcher._listener.notes == heard + 1
        assert first.token == 1  # the row the watch made is free, and tokens start at 1


async def _heard_more_than(pg_backend: PostgresBackend, count: int) -> None:
    await eventually(lambda: pg_backend._listener.notes > count, "notifications delivered")


async def test_a_killed_listener_wakes_waiters_and_reconnects(pg: str, schema: str) -> None:
    app = unique("aiolease_listener")
    url = with_query(pg, schema=schema, application_name=app)
    async with backend(url, poll_interval=60) as waiter, backend(url) as other:
        name = unique("killed")
        granted = await grant(other, name, "owner-1", ttl=60)
        seen = await waiter.read(name)
        pg_waiter = inner(waiter, PostgresBackend)
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter.wait_changed, name, seen)
            await waiting(waiter)
            await raw(
                pg,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = $1 AND query LIKE 'LISTEN%'",
                app,
            )
            # The waiter returns although nothing changed: it never hangs on a dead listener.
            await eventually(lambda: pg_waiter.statistics().waiting == 0, "the waiter waking")
            assert not pg_waiter.statistics().listening
            tg.cancel_scope.cancel()
        # The next wait listens again, and NOTIFY works as before.
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter.wait_changed, name, seen)
            await waiting(waiter)
            assert pg_waiter.statistics().listening
            assert pg_waiter.statistics().listener_connects == 2
            assert await other.release(name, "owner-1", granted.token)
            await eventually(lambda: pg_waiter.statistics().waiting == 0, "NOTIFY after reconnect")


async def test_waiting_polls_while_the_listener_cannot_connect(pg: str, schema: str) -> None:
    host, port = server("postgres").addresses[0]
    async with FaultProxy(host, port) as proxy:
        url = with_query(pg, schema=schema)
        options: dict[str, Any] = {
            "listen_url": proxy.url_for(pg),
            "poll_interval": 0.2,
            "connect_timeout": 2,
        }
        async with backend(url, **options) as waiter, backend(url) as other:
            pg_waiter = inner(waiter, PostgresBackend)
            name = unique("fallback")
            granted = await grant(other, name, "owner-1", ttl=60)
            seen = await waiter.read(name)
            await waiter.wait_changed(name, None)  # listens, returns at once
            assert pg_waiter.statistics().listening
            await proxy.reset()  # drops the listener, and every reconnect
            await eventually(lambda: not pg_waiter.statistics().listening, "the listener dropping")
            with anyio.fail_after(10):  # polling every 0.2 s notices the release
                async with anyio.create_task_group() as tg:
                    tg.start_soon(waiter.wait_changed, name, seen)
                    await waiting(waiter)
                    assert await other.release(name, "owner-1", granted.token)
            await proxy.pass_through()
            with anyio.fail_after(20):  # reconnects after a back-off of a few polls
                while not pg_waiter.statistics().listening:
                    await waiter.wait_changed(name, seen)  # free: returns at once
            assert pg_waiter.statistics().listener_connects >= 2


async def test_without_listen_there_is_no_push(pg_url: str) -> None:
    async with backend(pg_url, listen=False, poll_interval=0.1) as b:
        assert Capability.PUSH_WAKEUP not in b.capabilities
        name = unique("nolisten")
        granted = await grant(b, name, "owner-1")
        seen = await b.read(name)
        assert await b.release(name, "owner-1", granted.token)
        await b.wait_changed(name, seen)
        assert not inner(b, PostgresBackend).statistics().listening


# -- hand-offs and reads without statements -------------------------------------------------------


async def test_a_release_hands_the_name_to_the_oldest_waiter(pg_url: str) -> None:
    async with backend(pg_url, poll_interval=60) as b:
        await check_oldest_waiter_gets_it(b, lambda n: waiting(b, n))


async def test_a_cached_read_of_a_held_lease_sees_a_takeover(
    pg: str, pg_url: str, schema: str
) -> None:
    # A read of a lease held through the backend needs no statement while the listener
    # shows no change; a takeover's NOTIFY must end that at once.
    async with backend(pg_url, poll_interval=60) as mine, backend(pg_url) as other:
        async with anyio.create_task_group() as tg:  # a wait connects the listener
            tg.start_soon(mine.wait_changed, unique("listen"), None)
            await eventually(
                lambda: inner(mine, PostgresBackend).statistics().listening, "the listener"
            )
            tg.cancel_scope.cancel()
        name = unique("cached")
        await grant(mine, name, "owner-1", ttl=60)
        seen = await mine.read(name)
        assert seen is not None and seen.owner == "owner-1"
        await raw(
            pg,
            f'UPDATE "{schema}".aiolease_leases SET expires_at = clock_timestamp() WHERE name = $1',
            name,
        )
        await grant(other, name, "owner-2")  # takes over the expired row: NOTIFY
        with anyio.fail_after(5):  # a read still answered from memory would wait 10 s
            await mine.wait_changed(name, seen)
        now = await mine.read(name)
        assert now is not None and now.owner == "owner-2" and now.token == seen.token + 1


# -- takeovers by notification (on_taken) -------------------------------------------------------


@pytest.mark.parametrize("how", ["steal", "release"])
async def test_a_takeover_ends_the_holder_at_once_by_notification(
    pg: str, pg_url: str, schema: str, how: str
) -> None:
    async with backend(pg_url) as b, backend(pg_url) as other:
        spy = FaultyBackend(b)
        name = unique("taken")
        # A long ttl: the first renewal is far away, so only the notification can end it.
        with pytest.raises(LeaseLostError) as caught, anyio.fail_after(20):
            async with AsyncLock(spy, name, ttl=60) as lease:
                assert inner(b, PostgresBackend).statistics().listening  # from the start
                if how == "steal":  # the row expires, and another backend takes it
                    await raw(
                        pg,
                        f'UPDATE "{schema}".aiolease_leases'
                        " SET expires_at = clock_timestamp() WHERE name = $1",
                        name,
                    )
                    await grant(other, name, "thief")
                else:  # another backend releases it in the holder's name
                    assert await other.release(name, lease.owner, lease.token)
                await anyio.sleep_forever()
        assert caught.value.reason is LossReason.STOLEN
        # By callback: no watch task, no read, and no renewal was involved.
        assert spy.calls["on_taken"] == 1
        assert spy.calls["wait_taken"] == spy.calls["read"] == spy.calls["renew"] == 0


async def test_a_holder_released_normally_is_not_taken(pg_url: str) -> None:
    async with backend(pg_url) as b:
        spy = FaultyBackend(b)
        name = unique("kept")
        for _ in range(3):  # each grant and release notifies the holder's own listener
            async with AsyncLock(spy, name, ttl=60) as lease:
                holder = await b.read(name)
                assert holder is not None and holder.owner == lease.owner
            assert lease.lost is LossReason.RELEASED
        assert spy.calls["on_taken"] == 3
        assert len(inner(b, PostgresBackend)._takers) == 0  # every one unsubscribed


@pytest.mark.parametrize(
    ("payload", "parsed"),
    [
        ("r12:name", ("r", "name", None, 12)),
        ("r12:a:b", ("r", "a:b", None, 12)),
        ("g3:5:ownerna:me", ("g", "na:me", "owner", 3)),
        ("g3:0:x", ("g", "x", "", 3)),
        ("g3:9:short", ("r", "g3:9:short", None, None)),  # a length past the end
        ("gx:1:ab", ("r", "gx:1:ab", None, None)),
        ("h4:7:1500:5:ownername", ("g", "name", "owner", 4)),  # a hand-off, for 1.5 s
        ("h4:7:5:ownername", ("r", "h4:7:5:ownername", None, None)),  # no duration
        ("h4:7:-1:5:ownername", ("r", "h4:7:-1:5:ownername", None, None)),
        ("r\u00b2:x", ("r", "r\u00b2:x", None, None)),  # a digit that int() refuses
        ("rname", ("r", "rname", None, None)),  # the old format: a release, token unknown
        ("p:na:me", ("p", "na:me", None, None)),  # a permit or queue entry of "na:me" went
        ("", ("r", "", None, None)),
    ],
)
def test_payloads_parse_or_count_as_releases_of_unknown_tokens(
    payload: str, parsed: tuple[str, str, str | None, int | None]
) -> None:
    assert parse_payload(payload) == parsed


def test_a_hand_off_says_the_waiters_ask_and_how_long_the_grant_lasts_at_most() -> None:
    assert parse_notice("h4:7:1500:5:ownerna:me") == ("g", "na:me", "owner", 4, 7, 1.5)
    assert parse_notice("g4:5:ownername") == ("g", "name", "owner", 4, None, None)
    assert parse_notice("h4:x:1:5:ownername")[0] == "r"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the queue runs in the backend's loop
async def test_a_hand_off_re_times_the_other_waiters_and_ends_the_wait_of_none_of_them() -> None:
    queue = Queue()
    asks = {owner: queue.sending("n", owner, 30.0, now()) for owner in ("a", "b")}
    for owner, ask in asks.items():
        queue.refused("n", owner, ask)
    a, b = queue.get("n", "a"), queue.get("n", "b")
    assert a is not None and b is not None
    queue.handed("n", "a", 5, asks["a"], 1.5)
    assert a.woken and a.handed is not None and a.handed[0] == 5  # its grant: ask now
    assert b.event.is_set() and not b.woken  # woken to wait on, until the grant ends
    assert now() < b.until <= now() + 1.5
    until = b.until
    queue.handed("n", "x", 4, None, 100.0)  # an older hand-off, told late: no later
    assert b.until == until
    queue.released("n")  # a release ends the wait
    assert b.woken


def test_grants_of_free_names_have_a_channel_of_their_own() -> None:
    assert grants_channel("aiolease_0123") == "aiolease_0123_g"
    long = "c" * 63
    assert grants_channel(long) != long and len(grants_channel(long)) <= 63
