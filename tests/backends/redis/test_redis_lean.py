"""The Redis backend's fast paths on a real server: the lean connection, fair hand-offs
confirmed by their message, and watches that need no second read.

Each test uses a key prefix of its own on the shared test server and deletes its keys.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

import aiolease
from aiolease import AsyncLock, Lease, LossReason
from aiolease.abc import Backend, Grant, HolderInfo
from aiolease.backends.redis import ForeignDataError, RedisBackend
from aiolease.backends.redis._keys import Keys
from aiolease.backends.redis._resp import LeanClient
from aiolease.backends.redis._scripts import RENEW
from aiolease.backends.redis._transport import LeanTransport, RedisPyTransport
from aiolease.backends.redis._url import lean_endpoint
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.proxy import FaultProxy
from tests.backends.redis.support import in_database, inner, subscribe

pytestmark = pytest.mark.anyio
asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])
LONG = 30.0


@asynccontextmanager
async def lean(url: str, **options: Any) -> AsyncIterator[LeanClient]:
    """A lean client configured as the backend would configure it from ``url`` with
    ``options`` in its query."""
    query = "&".join(f"{key}={value}" for key, value in options.items())
    endpoint = lean_endpoint(f"{url}{'&' if '?' in url else '?'}{query}" if query else url, 5.0)
    assert endpoint is not None
    client = LeanClient(endpoint)
    try:
        yield client
    finally:
        await client.aclose()


def counted(backend: Backend) -> Counter[str]:
    """Count the scripts the RedisBackend behind ``backend`` runs, by name."""
    found = getattr(backend, "inner", backend)
    assert isinstance(found, RedisBackend)
    calls: Counter[str] = Counter()
    original = found._eval

    async def _eval(name: str, script: Any, keys: Any, *args: Any) -> Any:
        calls[script.name] += 1
        return await original(name, script, keys, *args)

    found._eval = _eval  # type: ignore[method-assign]
    return calls


def test_only_what_a_lean_connection_can_do_gets_one() -> None:
    endpoint = lean_endpoint("redis://u:p%40ss@h:1/2?client_name=x&socket_timeout=3", 5.0)
    assert endpoint is not None
    assert (endpoint.host, endpoint.port, endpoint.db, endpoint.timeout) == ("h", 1, 2, 3)
    assert (endpoint.username, endpoint.password, endpoint.client_name) == ("u", "p@ss", "x")
    assert endpoint.connect_timeout == 5.0
    sock = lean_endpoint("unix:///tmp/r.sock?db=4", 1.0)
    assert sock is not None and (sock.path, sock.db, sock.host) == ("/tmp/r.sock", 4, None)
    assert lean_endpoint("redis://h:1/2?db=3", 5.0) == lean_endpoint("redis://h:1/3", 5.0)
    assert lean_endpoint("rediss://h:1/0", 5.0) is None
    assert lean_endpoint("redis://h:1/0?protocol=3", 5.0) is None
    assert lean_endpoint("redis+cluster://h:1", 5.0) is None


async def test_the_transport_option_chooses_how_commands_travel(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    for choice, kind in (("auto", LeanTransport), ("lean", LeanTransport)):
        async with aiolease.open_backend(redis_url, prefix=prefix, transport=choice) as backend:
            assert isinstance(inner(backend)._wire, kind)
    async with aiolease.open_backend(redis_url, prefix=prefix, transport="redis-py") as backend:
        assert isinstance(inner(backend)._wire, RedisPyTransport)
        assert inner(backend).release_now("x", "me", 1) is None  # redis-py writes when awaited
    async with aiolease.open_backend(redis_url, prefix=prefix, wait_replicas=0) as backend:
        assert isinstance(inner(backend)._wire, LeanTransport)
    for bad in ("lean&wait_replicas=1", "tcp"):
        with pytest.raises(aiolease.InvalidArgument, match="transport"):
            await aiolease.open_backend(f"{redis_url}?transport={bad}").__aenter__()


@asyncio_only
async def test_replies_stay_in_step_when_callers_are_cancelled(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    async with lean(redis_url) as client:
        names = [f"{prefix}k{i}" for i in range(40)]
        for i, name in enumerate(names):
            await client.execute("SET", name, i)
        tasks = [asyncio.ensure_future(client.execute("GET", name)) for name in names]
        await asyncio.sleep(0)  # every GET is written
        for task in tasks[::2]:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for i, (task, result) in enumerate(zip(tasks, results, strict=True)):
            assert task.cancelled() or result == str(i).encode(), (i, result)
        assert sum(task.cancelled() for task in tasks) > 0
        # the replies of the cancelled ones were dropped, not handed to later callers
        for i, name in enumerate(names):
            assert await client.execute("GET", name) == str(i).encode()


@asyncio_only
async def test_a_timeout_closes_the_connection_and_the_next_command_connects(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    async with lean(redis_url, socket_timeout=0.2) as client:
        with pytest.raises(RedisTimeoutError):
            await client.execute("BLPOP", f"{prefix}never", 30)
        assert await client.execute("PING") == b"PONG"


@asyncio_only
async def test_a_connection_the_server_closed_is_replaced(
    anyio_backend: str, redis_url: str
) -> None:
    name = f"aiolease-lean-{uuid.uuid4().hex[:8]}"
    async with lean(redis_url, client_name=name) as client:
        assert await client.execute("PING") == b"PONG"
        with redis.Redis.from_url(redis_url) as admin:
            (first,) = [c["id"] for c in admin.client_list() if c["name"] == name]
            admin.client_kill_filter(_id=first)
            with suppress(RedisConnectionError):  # the loss may be seen only now
                await client.execute("PING")
            assert await client.execute("PING") == b"PONG"
            (second,) = [c["id"] for c in admin.client_list() if c["name"] == name]
        assert second != first


async def test_the_lean_connection_uses_the_urls_database(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    url = in_database(redis_url, 5)
    async with aiolease.open_backend(url, prefix=prefix) as backend:
        granted = await backend.try_acquire("db", "me", LONG, "me", {})
        assert isinstance(granted, Grant)
    lease_key = Keys.of(prefix, "db").lease
    with redis.Redis.from_url(url) as in_5, redis.Redis.from_url(in_database(redis_url, 0)) as in_0:
        assert in_5.exists(lease_key) and not in_0.exists(lease_key)


def requests(backend: Backend) -> Counter[str]:
    """Count the commands the RedisBackend behind ``backend`` sends through its transport
    (not its pub/sub connection), by command, and the requests (``"requests"``: each
    one write of one or more commands)."""
    wire = inner(backend)._wire
    calls: Counter[str] = Counter()
    call, batch, batch_now = wire.call, wire.batch, wire.batch_now

    def note(commands: Any) -> None:
        calls["requests"] += 1
        for command in commands:
            calls[str(command[0]).split()[0]] += 1

    async def counted_call(*args: Any) -> Any:
        note([args])
        return await call(*args)

    async def counted_batch(commands: Any, **options: Any) -> Any:
        note(commands)
        return await batch(commands, **options)

    def counted_batch_now(commands: Any) -> Any:
        note(commands)
        return batch_now(commands)

    wire.call = counted_call  # type: ignore[method-assign]
    wire.batch = counted_batch  # type: ignore[method-assign]
    wire.batch_now = counted_batch_now  # type: ignore[method-assign]
    return calls


@asyncio_only
async def test_a_block_sends_its_release_before_its_own_bookkeeping(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """Leaving ``async with`` writes the release first: the lease is ended, and its
    guards dropped, with the request on its way (a waiter that the release serves
    waits for the request, not for them). (Under trio, the asyncio bridge releases
    as :meth:`Lease.release` does.)"""
    async with aiolease.open_backend(redis_url, prefix=prefix) as backend:
        sent = requests(backend)
        ended: list[tuple[LossReason, int]] = []
        async with AsyncLock(backend, "first", ttl=LONG) as lease:
            assert sent["EVALSHA"] == 1
            lease.on_end(lambda reason: ended.append((reason, sent["EVALSHA"])))
        assert ended == [(LossReason.RELEASED, 2)]
        assert await backend.read("first") is None


@asyncio_only  # made directly: under trio, only open_backend() bridges it
async def test_a_subclass_with_a_release_of_its_own_has_it_called(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    class Noting(RedisBackend):
        releases = 0

        async def release(self, name: str, owner: str, token: int | None) -> bool:
            self.releases += 1
            return await super().release(name, owner, token)

    backend = await Noting.from_url(redis_url, prefix=prefix)
    try:
        async with AsyncLock(backend, "own", ttl=LONG):
            pass
        assert backend.releases == 1 and await backend.read("own") is None
    finally:
        await backend.aclose()


def released_alone(sent: Counter[str]) -> bool:
    """Whether ``sent`` is one RELEASE script (and the ``PING`` it may start with)."""
    return sent["requests"] == sent["EVALSHA"] == 1 and set(sent) <= {"requests", "EVALSHA", "PING"}


async def test_a_fair_hand_off_is_confirmed_by_its_message(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        await subscribe(backend, "fair")
        holder = await AsyncLock(backend, "fair", ttl=LONG).acquire()
        refused = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(refused, HolderInfo)
        attempted = anyio.current_time()  # the attempt was sent before this
        sent = requests(backend)
        with anyio.fail_after(LONG / 6):  # far below the waiter's retry (ttl / 3)
            async with anyio.create_task_group() as tg:
                tg.start_soon(backend.wait_turn, "fair", "waiter", LONG, refused)
                await holder.release()  # hands the lease to the waiter, and announces it
        granted = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(granted, Grant) and granted.token == holder.token + 1
        # the release alone: no wake-up list to wait on, no attempt to confirm the grant
        assert released_alone(sent), "the message should have confirmed the grant"
        # counted from the attempt: the hand-off came later, so the deadline is safe
        assert granted.sent_at is not None and granted.sent_at <= attempted
        assert 0 < granted.ttl <= LONG
        current = await backend.read("fair")
        assert current is not None and (current.owner, current.token) == ("waiter", granted.token)


async def test_an_older_hand_off_message_confirms_nothing(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """A message naming the waiter counts only if its token is newer than the holder its
    latest attempt was refused with; an older one only makes it look again."""
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        channel = Keys.of(prefix, "fair").channel
        await subscribe(backend, "fair")
        holder = await backend.try_acquire("fair", "holder", LONG, "holder", {})
        assert isinstance(holder, Grant)
        refused = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(refused, HolderInfo)
        with redis.Redis.from_url(redis_url) as admin:  # as if a stale one arrived late
            admin.publish(channel, b"waiter\n%d:%d" % (holder.token, LONG * 1000))
        with anyio.fail_after(LONG / 6):
            await backend.wait_turn("fair", "waiter", LONG, refused)
        again = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(again, HolderInfo) and again.owner == "holder"
        assert await backend.release("fair", "holder", holder.token)
        assert await backend.release("fair", "waiter", None)


async def test_a_waiter_not_subscribed_since_its_attempt_subscribes_and_tries_again(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        holder = await backend.try_acquire("fair", "holder", LONG, "holder", {})
        assert isinstance(holder, Grant)  # no lock: nobody subscribed the channel
        refused = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(refused, HolderInfo)
        with anyio.fail_after(LONG / 6):  # a hand-off might have come unheard: no wait
            await backend.wait_turn("fair", "waiter", LONG, refused)
        refused = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(refused, HolderInfo)
        sent = requests(backend)
        with anyio.fail_after(LONG / 6):  # subscribed since this attempt: the message counts
            async with anyio.create_task_group() as tg:
                tg.start_soon(backend.wait_turn, "fair", "waiter", LONG, refused)
                assert await backend.release("fair", "holder", holder.token)
        granted = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(granted, Grant) and granted.token == holder.token + 1
        assert released_alone(sent)
        assert await backend.release("fair", "waiter", granted.token)


async def take_once(backend: Backend, name: str, got: list[Any]) -> None:
    """Acquire ``name`` (waiting as long as it takes), note the token, release."""
    lease = await AsyncLock(backend, name, ttl=LONG).acquire()
    got.append(lease.token)
    await lease.release()


def noting_rides(found: RedisBackend) -> anyio.Event:
    """An event set when an attempt through ``found`` starts to wait for a release to
    ride with."""
    riding = anyio.Event()
    ride = found._riders.ride

    async def noted_ride(name: str, args: Any, alone: Any) -> Any:
        riding.set()
        return await ride(name, args, alone)

    found._riders.ride = noted_ride  # type: ignore[method-assign]
    return riding


@asynccontextmanager
async def holding_here(
    redis_url: str, prefix: str
) -> AsyncIterator[tuple[Backend, Lease, anyio.Event]]:
    """A fair backend, a lease on "fair" held through it, and an event set when an
    attempt through it starts to wait for the lease's release, which alone sends it."""
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        found = inner(backend)
        await subscribe(backend, "fair")
        holder = await AsyncLock(backend, "fair", ttl=LONG).acquire()
        found._riders._wait = LONG
        yield backend, holder, noting_rides(found)


async def test_an_attempt_rides_with_the_release_of_a_local_holder(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """A waiter's attempt while a task of the same backend holds the lease goes with the
    holder's release, which runs it right after: no request, and no reply, during the
    hold."""
    async with holding_here(redis_url, prefix) as (backend, holder, riding):
        sent = requests(backend)
        got: list[int] = []

        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(take_once, backend, "fair", got)
                await riding.wait()
                assert sent["requests"] == 0
                await holder.release()
        # the queue was empty: the attempt right after the release was granted
        assert got == [holder.token + 1]
        # the holder's release, which ran the waiter's attempt, then the waiter's release
        assert (sent["requests"], sent["EVALSHA"]) == (2, 2)


async def attempt_into(backend: Backend, name: str, outcome: list[object]) -> None:
    """Acquire ``name`` (waiting as long as it takes) and release it; what happened
    into ``outcome``: the token, or the backend error raised."""
    try:
        await take_once(backend, name, outcome)
    except aiolease.BackendError as exc:
        outcome.append(exc)


async def test_an_attempt_that_fails_in_the_release_it_rode_with_fails_alone(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """The release script runs a riding attempt under ``pcall``: its error is its own
    reply, and the release stands."""
    async with holding_here(redis_url, prefix) as (backend, holder, riding):
        with redis.Redis.from_url(redis_url) as admin:  # the grant's INCR will fail
            admin.set(Keys.of(prefix, "fair").token, "not a counter")
        outcome: list[object] = []
        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(attempt_into, backend, "fair", outcome)
                await riding.wait()
                assert await holder.release()
        (error,) = outcome
        assert isinstance(error, ForeignDataError)
        assert await backend.read("fair") is None


async def test_a_riding_attempt_of_the_waiter_the_release_hands_off_to_picks_it_up(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """A queued waiter that tries again while the holder here holds rides with the
    release; the release hands the lease to it, and its attempt picks it up."""
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        found = inner(backend)
        await subscribe(backend, "fair")
        holder = await AsyncLock(backend, "fair", ttl=LONG).acquire()
        found._riders._wait = 0  # the waiter's first attempt goes alone: it is queued
        refused = await backend.try_acquire("fair", "waiter", LONG, "waiter", {})
        assert isinstance(refused, HolderInfo) and refused.owner == holder.owner
        found._riders._wait = LONG  # its next one rides with the release
        riding = noting_rides(found)
        granted: list[object] = []

        async def try_again() -> None:
            granted.append(await backend.try_acquire("fair", "waiter", LONG, "waiter", {}))

        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(try_again)
                await riding.wait()
                assert await holder.release()
        (grant,) = granted
        assert isinstance(grant, Grant) and grant.token == holder.token + 1
        assert await backend.release("fair", "waiter", grant.token)


async def test_riders_of_a_release_whose_script_is_gone_go_alone(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """``SCRIPT FLUSH`` (a restart, a failover) during a hold: the release and the
    attempt riding with it load their scripts and run on their own."""
    async with holding_here(redis_url, prefix) as (backend, holder, riding):
        outcome: list[object] = []
        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(attempt_into, backend, "fair", outcome)
                await riding.wait()
                with redis.Redis.from_url(redis_url) as admin:
                    admin.script_flush()
                assert await holder.release()
        assert outcome == [holder.token + 1]


def noting_waits(found: RedisBackend) -> anyio.Event:
    """An event set when a waiter of ``found`` starts waiting for its turn."""
    waiting = anyio.Event()
    wait_turn = found.wait_turn

    async def noted_wait_turn(name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        waiting.set()
        await wait_turn(name, owner, ttl, seen)

    found.wait_turn = noted_wait_turn  # type: ignore[method-assign]
    return waiting


async def test_an_attempt_goes_alone_when_the_local_holder_keeps_the_lease(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        found = inner(backend)
        await subscribe(backend, "fair")
        holder = await AsyncLock(backend, "fair", ttl=LONG).acquire()
        waiting = noting_waits(found)
        got: list[int] = []

        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(take_once, backend, "fair", got)
                await waiting.wait()  # refused and queued without the holder's release
                await holder.release()
        assert got == [holder.token + 1]


def pubsub_connections(url: str, client_name: str) -> list[str]:
    """The ids of the server's pub/sub connections called ``client_name``."""
    with redis.Redis.from_url(url) as admin:
        return [c["id"] for c in admin.client_list(_type="pubsub") if c["name"] == client_name]


class Order:
    """The releases that a RedisBackend writes (``release``) and the waits for a turn
    that start (``wait``), in order."""

    def __init__(self, found: RedisBackend) -> None:
        self.seen: list[str] = []
        self._changed = anyio.Event()
        release, release_now, wait_turn = found.release, found.release_now, found.wait_turn

        async def noted_release(name: str, owner: str, token: int | None) -> bool:
            self._note("release")
            return await release(name, owner, token)

        def noted_release_now(name: str, owner: str, token: int) -> Any:
            self._note("release")
            return release_now(name, owner, token)

        async def noted_wait_turn(name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
            self._note("wait")
            await wait_turn(name, owner, ttl, seen)

        found.release = noted_release  # type: ignore[method-assign]
        found.release_now = noted_release_now  # type: ignore[method-assign]
        found.wait_turn = noted_wait_turn  # type: ignore[method-assign]

    def _note(self, what: str) -> None:
        self.seen.append(what)
        self._changed.set()
        self._changed = anyio.Event()

    async def reach(self, count: int) -> None:
        """Until ``count`` are noted."""
        while len(self.seen) < count:
            await self._changed.wait()


async def hold_until(backend: Backend, name: str, held: anyio.Event, go: anyio.Event) -> None:
    """Acquire ``name`` (waiting as long as it takes), set ``held``, release on ``go``."""
    async with AsyncLock(backend, name, ttl=LONG):
        held.set()
        await go.wait()


@dataclass
class Riding:
    """A lease held here (``first``), a waiter queued behind it that holds the lease
    once it is handed over (``held``) until told to release it (``go``), and an
    attempt riding with ``first``'s release, which takes the lease once (token into
    ``got``); ``order`` notes the releases and the waits."""

    first: Lease
    order: Order
    held: anyio.Event = field(default_factory=anyio.Event)
    go: anyio.Event = field(default_factory=anyio.Event)
    got: list[int] = field(default_factory=list)


async def queue_then_ride(backend: Backend, tg: anyio.abc.TaskGroup) -> Riding:
    """:class:`Riding` on "fair": ``first``'s release will hand the lease to the waiter
    and refuse the riding attempt."""
    found = inner(backend)
    await subscribe(backend, "fair")
    riding = Riding(await AsyncLock(backend, "fair", ttl=LONG).acquire(), Order(found))
    found._riders._wait = 0  # the waiter's attempt goes alone: it is queued
    tg.start_soon(hold_until, backend, "fair", riding.held, riding.go)
    await riding.order.reach(1)
    found._riders._wait = LONG  # the next attempt rides with the release
    started = noting_rides(found)
    tg.start_soon(take_once, backend, "fair", riding.got)
    await started.wait()
    return riding


@asyncio_only  # the riders are asyncio's: under trio the test cannot reach them
async def test_a_refusal_handed_back_with_a_local_hand_off_waits_for_the_next_release(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """An attempt that rode with a release handing the lease to a waiter here, and was
    refused, starts waiting for its turn once the new holder's release is written
    (in that request's round trip), not during the new holder's hold."""
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                riding = await queue_then_ride(backend, tg)
                await riding.first.release()  # its reply settled the riders
                await riding.held.wait()
                assert len(inner(backend)._riders._kept) == 1  # the refusal is kept
                assert riding.order.seen == ["wait", "release"]
                riding.go.set()
        assert riding.got == [riding.first.token + 2]
        # the new holder's release, the rider's wait for its turn, the rider's release
        assert riding.order.seen == ["wait", "release", "release", "wait", "release"]


@asyncio_only
async def test_a_kept_refusal_reaches_its_waiter_while_the_new_holder_holds_on(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """A refusal is kept for the riders' wait at most: a holder that keeps the lease
    does not hold up its waiters."""
    async with aiolease.open_backend(redis_url, prefix=prefix, fair=True) as backend:
        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                riding = await queue_then_ride(backend, tg)
                inner(backend)._riders._wait = 0.01
                await riding.first.release()
                await riding.held.wait()
                await riding.order.reach(3)
                assert riding.order.seen == ["wait", "release", "wait"]  # the lease still held
                riding.go.set()
        assert riding.got == [riding.first.token + 2]


async def test_a_waiter_whose_subscription_dropped_still_gets_its_turn(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    """The hand-off's message is lost with the connection: the waiter looks again once
    the channel is subscribed again, long before its own retry (ttl / 3)."""
    client_name = f"aiolease-dropped-{uuid.uuid4().hex[:8]}"
    url = f"{redis_url}?client_name={client_name}"
    async with aiolease.open_backend(url, prefix=prefix, fair=True) as backend:
        found = inner(backend)
        await subscribe(backend, "fair")
        holder = await backend.try_acquire("fair", "holder", LONG, "holder", {})
        assert isinstance(holder, Grant)
        waiting = noting_waits(found)  # set as it listens, before it first awaits
        got: list[int] = []

        with anyio.fail_after(LONG / 6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(take_once, backend, "fair", got)
                await waiting.wait()
                (killed,) = await anyio.to_thread.run_sync(
                    pubsub_connections, redis_url, client_name
                )
                with redis.Redis.from_url(redis_url) as admin:
                    admin.client_kill_filter(_id=killed)  # unsubscribed before it returns
                assert await backend.release("fair", "holder", holder.token)
        assert got == [holder.token + 1]


async def test_a_watch_from_the_latest_read_reads_no_more_and_misses_no_change(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    async with aiolease.open_backend(redis_url, prefix=prefix) as backend:
        calls = counted(backend)
        granted = await backend.try_acquire("watched", "x", LONG, "x", {})
        assert isinstance(granted, Grant)
        await backend.wait_changed("watched", None)  # held: returns at once, and subscribes
        seen = await backend.read("watched")
        reads = calls["read"]
        with anyio.move_on_after(0.2):  # nothing changes: it waits, and reads nothing
            await backend.wait_changed("watched", seen)
        assert calls["read"] == reads
        seen = await backend.read("watched")
        assert await backend.release("watched", "x", granted.token)  # a change after the read
        with anyio.fail_after(LONG / 3):  # it would wait out the holder's ttl otherwise
            await backend.wait_changed("watched", seen)


async def test_renewals_slower_than_a_third_of_the_ttl_still_confirm(
    anyio_backend: str, redis_url: str, prefix: str
) -> None:
    host, port = redis_url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    async with FaultProxy(host, int(port)) as proxy:
        async with aiolease.open_backend(proxy.url_for(redis_url), prefix=prefix) as backend:
            # Round trips of about 2.4 s: longer than ttl / 3 (2 s), which a batch is
            # allowed to be old when a renewal joins it, shorter than the renew interval.
            faulty = FaultyBackend(backend)
            lock = AsyncLock(faulty, "slow", ttl=6.0, renew_interval=2.9, margin=0.05)
            with redis.Redis.from_url(redis_url) as admin:
                # A server that never ran it (a fresh one, or after SCRIPT FLUSH) would
                # answer the first renewal NOSCRIPT: two more slow round trips.
                admin.script_load(RENEW.source)
            async with lock as lease:
                await proxy.delay(1.2)
                with anyio.fail_after(30):
                    for _ in range(3):  # the third renewal starts when the second has ended
                        await faulty.wait_called("renew")
                assert lock.statistics().renewals >= 2
                assert lease.lost is None
                await proxy.pass_through()
