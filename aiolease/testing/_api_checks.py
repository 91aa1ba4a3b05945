"""Conformance checks through the public API: AsyncLock and Elector on any backend."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from contextlib import aclosing
from typing import Any

import anyio

from .._elector import Elector
from .._exceptions import BackendTimeout, LeaseHeldError, LeaseLostError, UnsupportedCapability
from .._lease import Lease
from .._lock import AsyncLock
from ..abc import Backend, Capability
from ._support import (
    LONG_TTL,
    PROMPT,
    SHORT_TTL,
    TOLERANCE,
    BackendFactory,
    holder_of,
    increasing,
    require,
    task_group,
    unique_name,
    wait_free,
    within,
)

__all__ = [
    "check_elector_one_leader",
    "check_elector_proclaim",
    "check_lock_acquire_nowait",
    "check_lock_acquire_timeout",
    "check_lock_cancel_in_flight",
    "check_lock_cancel_while_waiting",
    "check_lock_mutual_exclusion",
    "check_lock_release_after_takeover",
    "check_lock_wakes_on_release",
]

#: How many tasks contend in the mutual-exclusion checks.
CONTENDERS = 4


#: How long a check of elector terms may run before it counts as hung. A hang guard,
#: not a speed figure: on an election-only backend every change of term is a group
#: rebalance (about 1 s each on Tansu, several seconds on a loaded machine), and the
#: three-term check makes four or five of them. 30 s was passed once in a CI run on a
#: slow 2-core machine (Kafka, with the other worker's tests beside it).
TERMS_GUARD = 60.0


def _wake_bound(backend: Backend) -> float:
    """How long a waiter may take to notice a release."""
    return PROMPT + 2 * backend.poll_interval


async def _hold(backend: Backend, name: str, identity: str = "holder") -> Lease:
    """Take ``name`` once (no background renewal; the ttl outlasts the check)."""
    return await AsyncLock(backend, name, ttl=LONG_TTL, identity=identity).acquire_nowait()


async def _require_free(backend: Backend, name: str, what: str) -> None:
    holder = await backend.read(name)
    require(holder is None, f"{what} left {name!r} held by {holder!r}")


async def check_lock_mutual_exclusion(factory: BackendFactory) -> None:
    """``async with AsyncLock`` admits one task at a time, with increasing tokens."""
    async with factory() as backend:
        name = unique_name()
        inside: list[str] = []
        tokens: list[int] = []

        async def contend(identity: str) -> None:
            try:
                async with AsyncLock(backend, name, ttl=5.0, identity=identity) as lease:
                    require(not inside, f"{identity} entered while {inside} held the lock")
                    inside.append(identity)
                    tokens.append(lease.token)
                    # Let every other contender run as far as the backend lets it.
                    await anyio.wait_all_tasks_blocked()
                    inside.remove(identity)
            except LeaseLostError as exc:
                raise AssertionError(f"{identity} lost the lock while holding it: {exc}") from exc

        with within(CONTENDERS * 2 * _wake_bound(backend), f"{CONTENDERS} contended holds"):
            async with task_group() as tg:
                for i in range(CONTENDERS):
                    tg.start_soon(contend, f"task-{i}")
        require(len(tokens) == CONTENDERS, f"only {len(tokens)} of {CONTENDERS} tasks got in")
        require(increasing(tokens), f"tokens not increasing: {tokens}")
        await _require_free(backend, name, "the last holder's exit")


async def check_lock_acquire_timeout(factory: BackendFactory) -> None:
    """``acquire(timeout=)`` raises ``TimeoutError`` on a held name and leaves nothing held."""
    async with factory() as backend:
        name = unique_name()
        lease = await _hold(backend, name)
        waiter = AsyncLock(backend, name, ttl=LONG_TTL, identity="waiter")
        try:
            await waiter.acquire(timeout=0.2)
        except TimeoutError:
            pass
        else:
            raise AssertionError("acquire(timeout=0.2) of a held name did not raise TimeoutError")
        holder = await holder_of(backend, name)
        require(holder.owner == lease.owner, "a timed-out acquire disturbed the holder")
        require(await lease.release(), "the holder's release failed")
        await _require_free(backend, name, "a timed-out acquire")
        mine = await waiter.acquire(timeout=_wake_bound(backend))
        require(mine.token > lease.token, "a free name was not granted with a newer token")
        await mine.release()


async def check_lock_acquire_nowait(factory: BackendFactory) -> None:
    """``acquire_nowait`` on a held name raises ``LeaseHeldError`` naming the holder."""
    async with factory() as backend:
        name = unique_name()
        lease = await _hold(backend, name, identity="first")
        try:
            await AsyncLock(backend, name, ttl=LONG_TTL).acquire_nowait()
        except LeaseHeldError as exc:
            require(exc.name == name, f"LeaseHeldError.name is {exc.name!r}")
            require(exc.holder is not None, "LeaseHeldError.holder is None")
            assert exc.holder is not None
            require(exc.holder.identity == "first", f"holder identity {exc.holder.identity!r}")
            require(exc.holder.token == lease.token, f"holder token {exc.holder.token}")
        else:
            raise AssertionError("acquire_nowait of a held name did not raise LeaseHeldError")
        require((await holder_of(backend, name)).owner == lease.owner, "the holder was disturbed")
        await lease.release()


async def check_lock_wakes_on_release(factory: BackendFactory) -> None:
    """A blocked ``acquire`` is granted soon after the holder releases (not at expiry)."""
    from .faults import FaultyBackend

    async with factory() as inner:
        spy = FaultyBackend(inner)
        name = unique_name()
        first = await _hold(inner, name)
        got: list[Lease] = []
        granted = anyio.Event()

        async def wait_for_it() -> None:
            got.append(await AsyncLock(spy, name, ttl=LONG_TTL).acquire())
            granted.set()

        async with task_group() as tg:
            tg.start_soon(wait_for_it)
            await spy.wait_called("wait_turn")
            await first.release()
            with within(_wake_bound(inner), "a blocked acquire waking after release"):
                await granted.wait()
        require(got[0].token > first.token, "the woken waiter got an older token")
        await got[0].release()


async def check_lock_cancel_while_waiting(factory: BackendFactory) -> None:
    """An acquire cancelled while it waits leaves nothing held, even after the release."""
    from .faults import FaultyBackend

    async with factory() as inner:
        spy = FaultyBackend(inner)
        name = unique_name()
        first = await _hold(inner, name)
        async with task_group() as tg:
            tg.start_soon(AsyncLock(spy, name, ttl=LONG_TTL).acquire)
            await spy.wait_called("wait_turn")
            tg.cancel_scope.cancel()
        await first.release()
        await _require_free(backend=inner, name=name, what="an acquire cancelled while waiting")
        if Capability.FAIR_QUEUE in inner.capabilities:
            # A queue entry left behind turns into a grant later; no event marks "never".
            await anyio.sleep(inner.poll_interval)
            await _require_free(inner, name, "an acquire cancelled in a fair queue")


async def check_lock_cancel_in_flight(factory: BackendFactory) -> None:
    """An acquire cancelled after the backend granted it, before the reply, is undone."""
    from .faults import FaultyBackend

    async with factory() as inner:
        spy = FaultyBackend(inner)
        spy.slow_reply("try_acquire", LONG_TTL)
        name = unique_name()
        async with task_group() as tg:
            tg.start_soon(AsyncLock(spy, name, ttl=LONG_TTL).acquire)
            with within(_wake_bound(inner), "the in-flight grant to reach the backend"):
                holder = await inner.read(name)
                while holder is None:
                    await inner.wait_changed(name, None)
                    holder = await inner.read(name)
            tg.cancel_scope.cancel()
        await _require_free(inner, name, "an acquire cancelled while its reply was in flight")


async def _acquire_short(backend: Backend, lock: AsyncLock) -> Lease:
    """``lock.acquire_nowait()`` of a :data:`SHORT_TTL` lease. Its grant must arrive within
    ``ttl - margin`` (0.25 s), which a loaded machine's round trip through a pooler or the
    trio bridge can exceed: the core then raises :class:`BackendTimeout` and gives the
    grant back (as it must). That is not what the checks using this are about, so a late
    grant is asked again, up to three times."""
    for _ in range(2):
        try:
            return await lock.acquire_nowait()
        except BackendTimeout:
            # Given back, or (if the give-back was lost too) expiring within the ttl.
            await wait_free(backend, lock.name, SHORT_TTL + 1.0 + TOLERANCE)
    return await lock.acquire_nowait()


async def check_lock_release_after_takeover(factory: BackendFactory) -> None:
    """``Lease.release()`` after the name expired and was taken returns ``False``."""
    async with factory() as backend:
        name = unique_name()
        stale = await _acquire_short(
            backend, AsyncLock(backend, name, ttl=SHORT_TTL, identity="stale")
        )
        await wait_free(backend, name, SHORT_TTL + 1.0 + TOLERANCE)
        fresh = await _hold(backend, name, identity="fresh")
        require(fresh.token > stale.token, "the takeover got an older token")
        require(stale.lost is not None, "a lease past its ttl does not report itself lost")
        require(await stale.release() is False, "release of a lost, taken-over lease returned True")
        require((await holder_of(backend, name)).owner == fresh.owner, "the new holder was freed")
        require(await fresh.release(), "the new holder's release failed")


async def check_elector_one_leader(factory: BackendFactory) -> None:
    """Three electors lead one at a time, and an observer sees each term."""
    async with factory() as backend:
        name = unique_name()
        identities = [f"candidate-{i}" for i in range(3)]
        seen = {identity: anyio.Event() for identity in identities}
        observed: list[tuple[str, int]] = []
        leading: list[str] = []
        terms: list[int] = []

        async def work(lease: Lease, identity: str) -> int:
            require(not leading, f"{identity} elected while {leading} leads")
            leading.append(identity)
            await seen[identity].wait()
            leading.remove(identity)
            terms.append(lease.token)
            return lease.token

        async def observe() -> None:
            watcher = Elector(backend, name, ttl=1.0, identity="observer")
            # observe() is an async generator (annotated as an iterator): close it here.
            stream = watcher.observe()
            async with aclosing(stream) as leaders:
                async for leader in leaders:
                    if leader is not None:
                        observed.append((leader.identity, leader.token))
                        seen[leader.identity].set()

        with within(TERMS_GUARD, "three elector terms seen by an observer"):
            async with task_group() as tg:
                tg.start_soon(observe)
                electors = [Elector(backend, name, ttl=1.0, identity=i) for i in identities]
                async with task_group() as candidates:
                    for elector in electors:
                        candidates.start_soon(elector.run, work, elector.identity)
                tg.cancel_scope.cancel()
        for elector in electors:
            losses = elector.statistics().losses
            require(not losses, f"{elector.identity} lost terms it never gave up: {losses}")
        require(len(terms) == 3, f"{len(terms)} terms ran, expected 3")
        require(increasing(terms), f"term tokens not increasing: {terms}")
        require(
            {token for _, token in observed} >= set(terms),
            f"the observer saw {observed}, not every term {terms}",
        )


async def check_elector_proclaim(factory: BackendFactory) -> None:
    """The leader's ``proclaim()`` reaches an observer's ``observe()`` and ``leader()``
    (the same term's token, the new metadata), and the term goes on: nothing takes the
    announcement for a takeover, and ``ensure_held()`` confirms the lease. Without
    :attr:`Capability.PROCLAIM`, ``proclaim()`` raises :class:`UnsupportedCapability`
    and the term goes on alike."""
    async with factory() as backend:
        name = unique_name()
        proclaims = Capability.PROCLAIM in backend.capabilities
        elector = Elector(backend, name, ttl=2.0, identity="leader", metadata={"v": "1"})
        watcher = Elector(backend, name, ttl=2.0, identity="observer")
        seen: dict[str, anyio.Event] = {"1": anyio.Event(), "2": anyio.Event()}
        tokens: dict[str, int] = {}

        async def observe() -> None:
            async with aclosing(watcher.observe()) as leaders:
                async for leader in leaders:
                    version = None if leader is None else leader.metadata.get("v")
                    if leader is not None and version in seen:
                        tokens[version] = leader.token
                        seen[version].set()

        with within(TERMS_GUARD, "a proclaim seen by an observer"):
            try:
                await _proclaim_in_a_term(elector, watcher, proclaims, observe, seen, tokens)
            except LeaseLostError as exc:
                raise AssertionError(f"the term was lost after a proclaim: {exc}") from exc
        require(elector.statistics().losses == {}, "the term was lost after a proclaim")


async def _proclaim_in_a_term(
    elector: Elector,
    watcher: Elector,
    proclaims: bool,
    observe: Callable[[], Coroutine[Any, Any, None]],
    seen: dict[str, anyio.Event],
    tokens: dict[str, int],
) -> None:
    async with elector.leadership() as lease, task_group() as tg:
        tg.start_soon(observe)
        await seen["1"].wait()
        if proclaims:
            await elector.proclaim({"v": "2"})
            with within(2 * 2.0 + PROMPT, "the proclaim seen by the observer"):
                await seen["2"].wait()
            require(tokens["2"] == lease.token, f"a proclaim changed the token: {tokens}")
            leader = await watcher.leader()
            require(
                leader is not None and dict(leader.metadata) == {"v": "2"},
                f"leader() after a proclaim reads {leader!r}",
            )
        else:
            try:
                await elector.proclaim({"v": "2"})
            except UnsupportedCapability:
                pass
            else:
                raise AssertionError("proclaim() without PROCLAIM did not raise")
        await lease.ensure_held()
        require(lease.lost is None, f"the term ended after a proclaim: {lease.lost}")
        tg.cancel_scope.cancel()
