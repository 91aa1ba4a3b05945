"""The remote backend: the contract over TCP, errors and send times crossing, cancellation
and the connection pool."""

from __future__ import annotations

from collections.abc import Mapping

import anyio
import anyio.lowlevel
import pytest

import aiolease
from aiolease import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    Capability,
    InvalidArgument,
    LossReason,
    NotOwnerError,
)
from aiolease.abc import Grant, HolderInfo
from aiolease.backends.memory import MemoryBackend
from aiolease.testing import CHECKS, Check
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.remote import RemoteBackend
from tests.testing.remote_support import owner, remote, serving

pytestmark = pytest.mark.anyio


# -- the contract -------------------------------------------------------------------------


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
async def test_conformance_over_remote(anyio_backend: str, check: Check) -> None:
    """The whole contract holds for a memory backend reached over TCP, under both loops."""
    async with serving(MemoryBackend()) as url:
        await check(lambda: aiolease.open_backend(url))


class _FairSlow(MemoryBackend):
    capabilities = frozenset({Capability.FAIR_QUEUE})
    poll_interval = 0.25


async def test_capabilities_and_poll_interval_are_the_served_backends() -> None:
    assert RemoteBackend("127.0.0.1", 1).capabilities == {Capability.MULTI_PROCESS}
    async with remote(_FairSlow()) as client:
        assert isinstance(client, RemoteBackend)
        assert client.capabilities == {Capability.FAIR_QUEUE, Capability.MULTI_PROCESS}
        assert client.poll_interval == 0.25
    async with remote(MemoryBackend()) as client:
        assert client.capabilities == MemoryBackend.capabilities | {Capability.MULTI_PROCESS}


class _Hooks(MemoryBackend):
    """Records the fair-queue and session hooks the core calls."""

    def __init__(self) -> None:
        super().__init__()
        self.turns: list[tuple[str, str, float, int]] = []
        self.lost = anyio.Event()

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        self.turns.append((name, owner, ttl, seen.token))

    async def wait_lost(self, name: str, owner: str, token: int) -> LossReason:
        await self.lost.wait()
        return LossReason.STOLEN


async def test_wait_turn_and_wait_lost_reach_the_served_backend() -> None:
    served = _Hooks()
    async with remote(served) as client:
        granted = await client.try_acquire("n", "a", 5, "ida", {})
        assert isinstance(granted, Grant)
        holder = await client.read("n")
        assert holder is not None
        await client.wait_turn("n", "b", 5, holder)
        assert served.turns == [("n", "b", 5, granted.token)]
        async with anyio.create_task_group() as tg:
            reasons: list[LossReason] = []

            async def wait() -> None:
                reasons.append(await client.wait_lost("n", "a", granted.token))

            tg.start_soon(wait)
            await anyio.wait_all_tasks_blocked()
            assert reasons == []
            served.lost.set()
        assert reasons == [LossReason.STOLEN]


async def test_open_backend_requires_what_the_server_serves() -> None:
    async with serving(MemoryBackend()) as url:
        async with aiolease.open_backend(url, require=[Capability.PUSH_WAKEUP]) as backend:
            assert Capability.PUSH_WAKEUP in backend.capabilities
        with pytest.raises(aiolease.UnsupportedCapability, match="fair_queue"):
            async with aiolease.open_backend(url, require=[Capability.FAIR_QUEUE]):
                pass


class _Raising(MemoryBackend):
    """Raises ``error`` from ``read`` while it is set."""

    error: Exception | None = None

    async def read(self, name: str) -> HolderInfo | None:
        if self.error is not None:
            raise self.error
        return await super().read(name)


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (NotOwnerError("n"), NotOwnerError),
        (InvalidArgument("bad"), InvalidArgument),
        (BackendUnavailable("down"), BackendUnavailable),
        (BackendTimeout("slow"), BackendTimeout),
        (BackendError("odd"), BackendError),
        (RuntimeError("bug"), BackendError),
        (KeyError("bug"), BackendError),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else v.__name__,
)
async def test_errors_cross_by_type(raised: Exception, expected: type[Exception]) -> None:
    served = _Raising()
    async with remote(served) as client:
        served.error = raised
        with pytest.raises(expected) as info:
            await client.read("n")
        assert type(info.value) is expected
        assert str(raised.args[0]) in str(info.value)
        if isinstance(raised, NotOwnerError):
            assert info.value.name == "n"  # type: ignore[attr-defined]
        served.error = None
        assert await client.read("n") is None  # the connection survived the error


async def test_faults_of_the_served_backend_cross_as_such() -> None:
    faulty = FaultyBackend(MemoryBackend())
    async with remote(faulty) as client:
        grant = await client.try_acquire("n", owner(1), 30, "me", {"k": "v"})
        assert isinstance(grant, Grant)
        with pytest.raises(NotOwnerError):
            await client.renew("n", owner(2), grant.token, 30)
        faulty.lose_reply("renew")
        with pytest.raises(BackendTimeout):
            await client.renew("n", owner(1), grant.token, 30)
        faulty.fail("read", times=1)
        with pytest.raises(BackendUnavailable):
            await client.read("n")
        holder = await client.read("n")
        assert holder is not None and holder.metadata == {"k": "v"}


class _SentAt(MemoryBackend):
    """Reports grants as confirmed ``shift`` seconds from the call (negative: before it)."""

    shift = -5.0

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        result = await super().try_acquire(name, owner, ttl, identity, metadata)
        if isinstance(result, Grant):
            return Grant(result.token, result.ttl, anyio.current_time() + self.shift)
        return result

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        grant = await super().renew(name, owner, token, ttl)
        return Grant(grant.token, grant.ttl, anyio.current_time() + self.shift)


async def test_an_earlier_send_time_crosses_as_a_duration() -> None:
    """The client's ``sent_at`` is its own send time minus the served backend's lead:
    never later than the served backend's (here both clocks are this process's)."""
    async with remote(_SentAt()) as client:
        before = anyio.current_time()
        grant = await client.try_acquire("n", owner(1), 30, "me", {})
        after = anyio.current_time()
        assert isinstance(grant, Grant) and grant.sent_at is not None
        assert before <= grant.sent_at + 5.0 <= after
        before = anyio.current_time()
        renewed = await client.renew("n", owner(1), grant.token, 30)
        after = anyio.current_time()
        assert renewed.sent_at is not None
        assert before <= renewed.sent_at + 5.0 <= after


async def test_a_send_time_after_the_request_came_is_dropped() -> None:
    served = _SentAt()
    served.shift = 5.0
    async with remote(served) as client:
        grant = await client.try_acquire("n", owner(1), 30, "me", {})
        assert isinstance(grant, Grant) and grant.sent_at is None
        async with remote(MemoryBackend()) as plain:
            granted = await plain.try_acquire("n", owner(1), 30, "me", {})
            assert isinstance(granted, Grant) and granted.sent_at is None


# -- cancellation and the connection pool ---------------------------------------------------


class _Observed(MemoryBackend):
    """Tells when a ``wait_changed`` enters, and when one is cancelled; ``read`` of
    ``"gated"`` waits for :attr:`gate`."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = anyio.Event()
        self.cancelled = anyio.Event()
        self.gate = anyio.Event()

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        self.entered.set()
        try:
            await super().wait_changed(name, seen)
        except anyio.get_cancelled_exc_class():
            self.cancelled.set()
            raise

    async def read(self, name: str) -> HolderInfo | None:
        if name == "gated":
            self.entered.set()
            try:
                await self.gate.wait()
            except anyio.get_cancelled_exc_class():
                self.cancelled.set()
                raise
        return await super().read(name)


async def test_cancelled_wait_changed_is_cancelled_on_the_server_and_spares_the_pool() -> None:
    served = _Observed()
    async with remote(served, max_idle=1) as client:
        grant = await client.try_acquire("n", owner(1), 30, "me", {})
        assert isinstance(grant, Grant)
        seen = await client.read("n")
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.wait_changed, "n", seen)
                await served.entered.wait()
                scope.cancel()
        with anyio.fail_after(10):  # a hang guard: the hang-up reaches the server
            await served.cancelled.wait()
        holder = await client.read("n")
        assert holder is not None and holder.owner == owner(1)
        assert await client.release("n", owner(1), grant.token) is True
        assert await client.read("n") is None


async def test_a_reply_to_a_cancelled_call_never_reaches_the_next_call() -> None:
    served = _Observed()
    async with remote(served, max_idle=1) as client:
        await client.try_acquire("other", owner(2), 30, "someone", {})
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.read, "gated")
                await served.entered.wait()
                scope.cancel()
        served.gate.set()  # had the connection been pooled, its reply would come next
        holder = await client.read("other")
        assert holder is not None and holder.owner == owner(2)


async def test_concurrent_calls_each_get_their_own_reply() -> None:
    async with remote(MemoryBackend(), max_idle=2) as client:
        names = [f"n{i}" for i in range(20)]
        for i, name in enumerate(names):
            await client.try_acquire(name, owner(i), 30, f"id-{i}", {})
        found: dict[str, str] = {}

        async def read(name: str) -> None:
            holder = await client.read(name)
            assert holder is not None
            found[name] = holder.identity

        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(read, name)
        assert found == {f"n{i}": f"id-{i}" for i in range(20)}


async def test_aclose_fails_calls_in_flight_and_later_calls() -> None:
    served = _Observed()
    async with serving(served) as url:
        client = await RemoteBackend.from_url(url)
        await client.try_acquire("n", owner(1), 30, "me", {})
        seen = await client.read("n")
        errors: list[BaseException] = []

        async def wait() -> None:
            try:
                await client.wait_changed("n", seen)
            except BackendUnavailable as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await served.entered.wait()
            await client.aclose()
        assert len(errors) == 1
        with pytest.raises(BackendUnavailable, match="closed"):
            await client.read("n")
        await client.aclose()  # idempotent
