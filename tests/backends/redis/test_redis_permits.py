"""Permits (semaphores, read-write locks) on a real Redis server and Cluster: what the
conformance suite cannot see from outside one backend object. Two backend objects
stand for two processes; the keys are inspected with a client of the test's own.
(The Cluster's case, one slot per name, is in test_redis_cluster.py.)

Each test uses a key prefix of its own and deletes its keys.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest

from aiolease import AsyncReadWriteLock, AsyncSemaphore, ForeignDataError, NotOwnerError
from aiolease._checked import HeldRenewals
from aiolease.abc import Grant, HolderInfo, permit_owner
from aiolease.backends.redis._keys import PermitKeys
from tests.backends.redis.support import Opener, inner, new_name, requests, sync_client

pytestmark = pytest.mark.anyio
LONG = 30.0


@pytest.fixture
def admin(redis_url: str) -> Iterator[object]:
    with sync_client(redis_url) as client:
        yield client


def server_ms(client: object) -> int:
    seconds, micros = client.time()  # type: ignore[attr-defined]
    return int(seconds) * 1000 + int(micros) // 1000


async def test_two_backends_never_hold_more_than_the_limit(
    anyio_backend: str, open_redis: Opener
) -> None:
    """Tasks on two backend objects share a limit of 2: never more inside at once, and
    a waiter on one is woken by a release on the other (well before the 10 s a
    waiter would otherwise wait to refresh its queue entry)."""
    name = new_name()
    inside, peak, tokens = 0, 0, []
    full = anyio.Event()
    async with open_redis() as first, open_redis() as second:

        async def body(backend: object) -> None:
            nonlocal inside, peak
            async with AsyncSemaphore(backend, name, limit=2, ttl=LONG) as permit:  # type: ignore[arg-type]
                tokens.append(permit.token)
                inside += 1
                peak = max(peak, inside)
                if inside == 2:
                    full.set()
                await full.wait()
                await anyio.lowlevel.checkpoint()
                inside -= 1

        with anyio.fail_after(8):
            async with anyio.create_task_group() as tg:
                for backend in (first, second, first, second, first, second):
                    tg.start_soon(body, backend)
        assert peak == 2
        assert sorted(tokens) == list(range(1, 7))  # one counter, every grant a new token
        assert await second.read_permits(name) is None


async def test_tokens_survive_the_release_of_every_permit(
    anyio_backend: str, open_redis: Opener, prefix: str, admin: object
) -> None:
    """The last release deletes the name's permit keys but the token counter, so the
    next grant (a writer now) still takes a larger token; locks count apart."""
    name = new_name()
    keys = PermitKeys.of(prefix, name)
    async with open_redis() as backend:
        rw = AsyncReadWriteLock(backend, name, ttl=LONG)
        async with rw.read() as reader:
            pass
        assert admin.exists(*keys.all[:5]) == 0  # type: ignore[attr-defined]
        assert admin.get(keys.token) == b"1"  # type: ignore[attr-defined]
        async with rw.write() as writer:
            assert writer.token > reader.token
        async with AsyncSemaphore(backend, name + "/other", limit=3, ttl=LONG) as other:
            assert other.token == 1
        lock = await backend.try_acquire(name, "lock-owner", LONG, "me", {})
        assert isinstance(lock, Grant) and lock.token == 1  # the lock's own counter


async def test_expiry_is_the_servers_time(
    anyio_backend: str, open_redis: Opener, prefix: str, admin: object
) -> None:
    """A permit is scored by the server's TIME + ttl, and judged by that score: moved
    into the past on the server's clock, the permit is gone for the next request and
    for its holder's renewal, whatever the client's clock says."""
    name, owner, other = new_name(), permit_owner(), permit_owner()
    keys = PermitKeys.of(prefix, name)
    async with open_redis() as backend:
        before = server_ms(admin)
        granted = await backend.try_acquire_permit(name, owner, LONG, "me", {}, 1, 1)
        after = server_ms(admin)
        assert isinstance(granted, Grant)
        score = admin.zscore(keys.held, owner)  # type: ignore[attr-defined]
        assert before + LONG * 1000 <= score <= after + LONG * 1000
        refused = await backend.try_acquire_permit(name, other, LONG, "you", {}, 1, 1)
        assert isinstance(refused, HolderInfo) and refused.owner == owner
        admin.zadd(keys.held, {owner: server_ms(admin) - 1})  # type: ignore[attr-defined]
        again = await backend.try_acquire_permit(name, other, LONG, "you", {}, 1, 1)
        assert isinstance(again, Grant) and again.token > granted.token
        with pytest.raises(NotOwnerError):
            await backend.renew(name, owner, granted.token, LONG)


async def test_locks_and_permits_renew_in_one_round_trip(
    anyio_backend: str, open_redis: Opener
) -> None:
    """A batch mixing locks and permits is one request, each answered for itself,
    also when the core hands the same cohort again (its commands then made once)."""
    name = new_name()
    async with open_redis() as backend:
        lock = await backend.try_acquire(name, "lock-owner", LONG, "me", {})
        owners = [permit_owner() for _ in range(3)]
        permits = [await backend.try_acquire_permit(name, o, LONG, "me", {}, 3, 1) for o in owners]
        assert isinstance(lock, Grant) and all(isinstance(p, Grant) for p in permits)
        renewals = HeldRenewals()
        renewals.append((name, "lock-owner", lock.token, LONG))
        renewals += [(name, o, p.token, LONG) for o, p in zip(owners, permits, strict=True)]
        renewals.insert(2, (name, permit_owner(), 99, LONG))  # nobody's
        sent = requests(backend)
        for tick in (1, 2):
            results = await backend.renew_many(renewals)
            assert sent["requests"] == tick
            kinds = [type(r) for r in results]
            assert kinds == [Grant, Grant, NotOwnerError, Grant, Grant]


async def test_foreign_values_are_refused_and_left(
    anyio_backend: str, open_redis: Opener, prefix: str, admin: object
) -> None:
    name = new_name()
    keys = PermitKeys.of(prefix, name)
    admin.set(keys.held, "not ours")  # type: ignore[attr-defined]
    async with open_redis() as backend:
        with pytest.raises(ForeignDataError):
            await backend.try_acquire_permit(name, permit_owner(), LONG, "me", {}, 2, 1)
        with pytest.raises(ForeignDataError):
            await backend.read_permits(name)
    assert admin.get(keys.held) == b"not ours"  # type: ignore[attr-defined]


async def test_a_lost_state_key_is_rebuilt_from_the_holders(
    anyio_backend: str, open_redis: Opener, prefix: str, admin: object
) -> None:
    """The held weight is kept in the state hash; if that key is gone (evicted, say),
    the next request counts the live permits again instead of overfilling the limit."""
    name = new_name()
    keys = PermitKeys.of(prefix, name)
    async with open_redis() as backend:
        for _ in range(2):
            granted = await backend.try_acquire_permit(name, permit_owner(), LONG, "me", {}, 3, 1)
            assert isinstance(granted, Grant)
        admin.delete(keys.state)  # type: ignore[attr-defined]
        third = await backend.try_acquire_permit(name, permit_owner(), LONG, "me", {}, 3, 1)
        fourth = await backend.try_acquire_permit(name, permit_owner(), LONG, "me", {}, 3, 1)
        assert isinstance(third, Grant) and isinstance(fourth, HolderInfo)
        permits = await backend.read_permits(name)
        assert permits is not None and (permits.limit, permits.used) == (3, 3)


async def test_a_release_after_the_state_key_was_lost_leaves_it_to_be_rebuilt(
    anyio_backend: str, open_redis: Opener, prefix: str, admin: object
) -> None:
    """A release (and a purge of an expired permit) after the state hash was evicted
    used to write a negative weight into a new hash, which every later request refused
    as foreign data: the semaphore was unusable until somebody deleted the key. Now it
    leaves the state to the next request to rebuild from the live permits."""
    name = new_name()
    keys = PermitKeys.of(prefix, name)
    async with open_redis() as backend:
        owners = [permit_owner() for _ in range(3)]
        grants = [await backend.try_acquire_permit(name, o, LONG, "me", {}, 3, 1) for o in owners]
        short = permit_owner()
        assert all(isinstance(g, Grant) for g in grants)
        admin.delete(keys.state)  # type: ignore[attr-defined]
        assert await backend.release(name, owners[0], grants[0].token)
        # The next request counts the two live permits again: one place is free.
        fourth = await backend.try_acquire_permit(name, short, LONG, "me", {}, 3, 1)
        assert isinstance(fourth, Grant)
        permits = await backend.read_permits(name)
        assert permits is not None and (permits.limit, permits.used) == (3, 3)
        admin.delete(keys.state)  # type: ignore[attr-defined]
        admin.zadd(keys.held, {short: 1})  # type: ignore[attr-defined]  # expired
        # The purge of the expired permit finds no state either: one place is free.
        fifth = await backend.try_acquire_permit(name, permit_owner(), LONG, "me", {}, 3, 1)
        assert isinstance(fifth, Grant)
        permits = await backend.read_permits(name)
        assert permits is not None and (permits.limit, permits.used) == (3, 3)


async def test_a_release_grants_the_waiter_whose_turn_came(
    anyio_backend: str, open_redis: Opener
) -> None:
    """A release grants the queued request whose turn came (the queue's head, which
    then fits) and announces it on the channel: only its wait ends, and its next
    attempt takes the grant from the message, without a request (it used to ask
    again: one more round trip per contended acquisition); the waiters behind it sleep
    on until their turn comes, also when the one ahead gives up its grant (a
    cancelled acquire's undo releases it)."""
    name = new_name()
    first, second, third, holder = (permit_owner() for _ in range(4))
    async with open_redis() as holding, open_redis() as waiting:
        held = await holding.try_acquire_permit(name, holder, LONG, "h", {}, 1, 1)
        assert isinstance(held, Grant)
        seen = await waiting.try_acquire_permit(name, first, LONG, "w", {}, 1, 1)
        assert isinstance(seen, HolderInfo)
        await waiting.wait_permit_turn(name, first, LONG, seen)  # subscribes, at once
        refusals: dict[str, HolderInfo] = {}
        for owner in (first, second, third):  # queued in this order, the channel subscribed
            refused = await waiting.try_acquire_permit(name, owner, LONG, "w", {}, 1, 1)
            assert isinstance(refused, HolderInfo)
            refusals[owner] = refused
        sent = requests(waiting)
        woken: list[str] = []
        turn = {owner: anyio.Event() for owner in (first, second, third)}

        async def wait(owner: str) -> None:
            await waiting.wait_permit_turn(name, owner, LONG, refusals[owner])
            woken.append(owner)
            turn[owner].set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for owner in (first, second, third):
                    tg.start_soon(wait, owner)
                assert await holding.release(name, holder, held.token)
                await turn[first].wait()
                granted = await waiting.try_acquire_permit(name, first, LONG, "w", {}, 1, 1)
                assert isinstance(granted, Grant) and granted.token > held.token
                assert granted.ttl <= LONG and granted.sent_at is not None
                assert woken == [first] and sent["requests"] == 0, (woken, sent)
                permits = await holding.read_permits(name)
                assert permits is not None and [h.owner for h in permits.holders] == [first]
                assert permits.holders[0].token == granted.token and permits.waiting == 2
                # The first frees its permit: the second's turn. The second gives up its
                # grant instead (a cancelled acquire's undo): the third's turn.
                assert await waiting.release(name, first, granted.token)
                await turn[second].wait()
                assert woken == [first, second]
                assert await waiting.release(name, second, None) is True
                await turn[third].wait()
                last = await waiting.try_acquire_permit(name, third, LONG, "w", {}, 1, 1)
                assert isinstance(last, Grant) and last.token > granted.token + 1
                assert woken == [first, second, third]
                assert await waiting.release(name, third, last.token)
        assert await holding.read_permits(name) is None


async def test_a_grant_to_a_waiter_that_is_gone_expires_with_its_queue_entry(
    anyio_backend: str, open_redis: Opener
) -> None:
    """A release grants the queue's head even if its waiter is gone (a process that
    died, or stopped): the grant lasts what was left of the queue entry, never longer
    than the ttl the waiter asked, and then frees its weight for the next request."""
    name = new_name()
    holder, gone, later = (permit_owner() for _ in range(3))
    async with open_redis() as backend:
        held = await backend.try_acquire_permit(name, holder, LONG, "h", {}, 1, 1)
        assert isinstance(held, Grant)
        refused = await backend.try_acquire_permit(name, gone, 0.5, "g", {}, 1, 1)
        assert isinstance(refused, HolderInfo)
        assert await backend.release(name, holder, held.token)
        permits = await backend.read_permits(name)
        assert permits is not None and [h.owner for h in permits.holders] == [gone]
        granted = permits.holders[0]
        assert granted.token > held.token and granted.remaining is not None
        assert granted.remaining <= 0.5
        blocked = await backend.try_acquire_permit(name, later, LONG, "l", {}, 1, 1)
        assert isinstance(blocked, HolderInfo) and blocked.owner == gone
        await anyio.sleep(granted.remaining + 0.05)  # the server's expiry: nothing to await
        last = await backend.try_acquire_permit(name, later, LONG, "l", {}, 1, 1)
        assert isinstance(last, Grant) and last.token > granted.token
        assert await backend.release(name, later, last.token)


# release_now of the RedisBackend itself, which runs on asyncio (a bridge under trio).
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_permits_release_is_written_at_once(anyio_backend: str, open_redis: Opener) -> None:
    """``release_now`` writes a permit's release before returning, as a lock's (it
    returned ``None``, and the core sent the release after its bookkeeping)."""
    name = new_name()
    owner = permit_owner()
    async with open_redis() as backend:
        redis = inner(backend)
        assert redis._wire.writes_now
        held = await backend.try_acquire_permit(name, owner, LONG, "h", {}, 2, 1)
        assert isinstance(held, Grant)
        sent = redis.release_now(name, owner, held.token)
        assert sent is not None
        assert await sent is True
        assert await backend.read_permits(name) is None
