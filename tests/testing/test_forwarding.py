"""Wrappers cannot drift from the contract: every public member of :class:`Backend`
reaches the wrapped backend through the trio bridge, :class:`FaultyBackend` and
:class:`RemoteBackend` (all :class:`~aiolease.abc.ForwardingBackend`).

Each member is probed through the wrapper around a :class:`Recorder`, which answers
at once and records what reached it; a member that :class:`Backend` gains without a
probe here fails :func:`test_every_member_is_probed`. The mutants below (a wrapper
that drops one member each) show that the probe catches a missing forward.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import cached_property
from typing import Any, NamedTuple

import anyio
import pytest

from aiolease import Capability, Events, LossReason
from aiolease._bridge import AsyncioBridge, running_trio
from aiolease.abc import (
    Backend,
    ForwardingBackend,
    Grant,
    HolderInfo,
    PermitHolders,
    Renewal,
    RenewResult,
)
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.remote import BackendServer, RemoteBackend

pytestmark = pytest.mark.anyio

HELD = HolderInfo("n", "o", "id", 7, {})


class _Clock:
    expires = 1e9
    error: BaseException | None = None


def _unsubscribe() -> None:
    """What :meth:`Recorder.on_taken` returns."""


class Recorder(Backend):
    """Answers every operation of the contract at once, and records its name."""

    capabilities = frozenset(Capability)  # every one: a wrapper that drops one shows
    poll_interval = 0.37  # not the default

    def __init__(self) -> None:
        self.calls: list[str] = []

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> Recorder:
        return cls()

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        self.calls.append("try_acquire")
        return Grant(7, ttl)

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        self.calls.append("renew")
        return Grant(token, ttl)

    async def renew_many(self, renewals: Sequence[Renewal]) -> Sequence[RenewResult]:
        self.calls.append("renew_many")
        return [Grant(token, ttl) for _, _, token, ttl in renewals]

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        self.calls.append("release")
        return True

    def release_now(self, name: str, owner: str, token: int) -> Awaitable[bool] | None:
        self.calls.append("release_now")
        return self._released()

    async def _released(self) -> bool:
        return True

    async def read(self, name: str) -> HolderInfo | None:
        self.calls.append("read")
        return HELD

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        self.calls.append("wait_changed")

    async def wait_taken(self, name: str, held: HolderInfo) -> None:
        self.calls.append("wait_taken")

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        self.calls.append("wait_turn")

    async def try_acquire_permit(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        self.calls.append("try_acquire_permit")
        return HELD

    async def read_permits(self, name: str) -> PermitHolders | None:
        self.calls.append("read_permits")
        return PermitHolders(name, 3, (HELD,), (1,), 2)

    async def wait_permit_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        self.calls.append("wait_permit_turn")

    async def wait_lost(self, name: str, owner: str, token: int) -> LossReason:
        self.calls.append("wait_lost")
        return LossReason.EXPIRED

    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        self.calls.append("update_metadata")

    def hold(
        self, name: str, owner: str, token: int, ended: Callable[[LossReason], object]
    ) -> _Clock:
        self.calls.append("hold")
        return _Clock()

    def on_taken(
        self, name: str, owner: str, token: int, taken: Callable[[LossReason], object]
    ) -> Callable[[], None]:
        self.calls.append("on_taken")
        return _unsubscribe

    async def aclose(self) -> None:
        self.calls.append("aclose")


def _ignore(reason: LossReason) -> None:
    """A callback that only records nothing."""


#: How each method of the contract is called (a coroutine, or what a plain hook returns).
PROBES: dict[str, Callable[[Backend], Any]] = {
    "try_acquire": lambda b: b.try_acquire("n", "o", 5.0, "id", {"k": "v"}),
    "renew": lambda b: b.renew("n", "o", 7, 5.0),
    "renew_many": lambda b: b.renew_many([("n", "o", 7, 5.0)]),
    "release": lambda b: b.release("n", "o", 7),
    "release_now": lambda b: b.release_now("n", "o", 7),
    "read": lambda b: b.read("n"),
    "wait_changed": lambda b: b.wait_changed("n", HELD),
    "wait_taken": lambda b: b.wait_taken("n", HELD),
    "wait_turn": lambda b: b.wait_turn("n", "o2", 5.0, HELD),
    "wait_lost": lambda b: b.wait_lost("n", "o", 7),
    "update_metadata": lambda b: b.update_metadata("n", "o", 7, {"k": "w"}),
    "try_acquire_permit": lambda b: b.try_acquire_permit("n", "o", 5.0, "id", {}, 3, 1),
    "read_permits": lambda b: b.read_permits("n"),
    "wait_permit_turn": lambda b: b.wait_permit_turn("n", "o2", 5.0, HELD),
    "hold": lambda b: b.hold("n", "o", 7, _ignore),
    "on_taken": lambda b: b.on_taken("n", "o", 7, _ignore),
    "aclose": lambda b: b.aclose(),  # last: it closes the wrapper
}
#: The properties and attributes a wrapper must report as the wrapped backend's.
ATTRIBUTES = ("capabilities", "renews_many", "poll_interval")
#: What a wrapper of this process shares with the wrapped backend (the same object); a
#: client over a wire has its own, in its own process.
SHARED = ("events",)
#: Members a wrapper has of its own, and why.
OWN = {
    "from_url": "a wrapper is made around a backend (a remote one from its own URL)",
    "requires_asyncio": "the loop the wrapper itself needs (the bridge's is none)",
}
#: The plain synchronous hooks: over a wire they cannot cross, and may decline.
PLAIN = ("release_now", "hold", "on_taken")


def _public_members() -> set[str]:
    return {name for name in dir(Backend) if not name.startswith("_")}


def test_every_member_is_probed() -> None:
    assert _public_members() == set(PROBES) | set(ATTRIBUTES) | set(SHARED) | set(OWN)


async def gaps(wrapper: Backend, inner: Recorder, *, far: bool) -> list[str]:
    """The members of the contract that ``wrapper`` does not hand to ``inner``.

    :param far: ``inner`` is reached over a wire: its capabilities gain
        :attr:`Capability.MULTI_PROCESS`, closing the wrapper leaves it open, and the
        plain hooks may decline, but only through
        :meth:`ForwardingBackend._forward_now`'s own default (the core then uses the
        awaited operations instead)
    """
    missing = []
    expected: dict[str, object] = {a: getattr(inner, a) for a in ATTRIBUTES}
    if far:
        expected["capabilities"] = inner.capabilities | {Capability.MULTI_PROCESS}
    missing += [a for a, value in expected.items() if getattr(wrapper, a) != value]
    if not far:
        missing += [a for a in SHARED if getattr(wrapper, a) is not getattr(inner, a)]
    declines = (
        far and getattr(type(wrapper), "_forward_now", None) is ForwardingBackend._forward_now
    )
    for name, probe in PROBES.items():
        inner.calls.clear()
        result = probe(wrapper)
        if inspect.isawaitable(result):
            result = await result
        if name in inner.calls:
            continue
        if (name in PLAIN and result is None and declines) or (name == "aclose" and far):
            continue
        missing.append(name)
    return missing


class Wrapped(NamedTuple):
    wrapper: Backend
    inner: Recorder
    far: bool


@asynccontextmanager
async def bridged() -> AsyncIterator[Wrapped]:
    if not running_trio():
        pytest.skip("the bridge runs asyncio backends under trio")
    import trio_asyncio

    inner = Recorder()
    async with trio_asyncio.open_loop():
        yield Wrapped(AsyncioBridge(inner), inner, False)


@asynccontextmanager
async def faulty() -> AsyncIterator[Wrapped]:
    inner = Recorder()
    yield Wrapped(FaultyBackend(inner), inner, False)


@asynccontextmanager
async def remote() -> AsyncIterator[Wrapped]:
    inner = Recorder()
    async with anyio.create_task_group() as tg:
        port = await tg.start(BackendServer(inner, port=0).serve)
        yield Wrapped(await RemoteBackend.from_url(f"remote://127.0.0.1:{port}"), inner, True)
        tg.cancel_scope.cancel()


WRAPPERS = {"bridge": bridged, "faulty": faulty, "remote": remote}


@pytest.mark.parametrize("make", WRAPPERS.values(), ids=WRAPPERS.keys())
async def test_wrappers_forward_every_member(anyio_backend: str, make: Callable[[], Any]) -> None:
    async with make() as wrapped:
        assert await gaps(wrapped.wrapper, wrapped.inner, far=wrapped.far) == []


# -- the probe catches a wrapper that drops one member ---------------------------------


class _TurnIsAChange(FaultyBackend):
    """Waits for a turn as a plain change (as FaultyBackend once did)."""

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        await self.wait_changed(name, seen)


class _PermitsPoll(FaultyBackend):
    """Waits for a permit's turn by the contract's default poll, not the wrapped one's."""

    async def wait_permit_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        await Backend.wait_permit_turn(self, name, owner, ttl, seen)


class _NoBatch(FaultyBackend):
    """Renews a batch one by one, and says it does not batch."""

    renews_many = False

    async def renew_many(self, renewals: Sequence[Renewal]) -> Sequence[RenewResult]:
        return await Backend.renew_many(self, renewals)


class _ClassCapabilities(FaultyBackend):
    """Declares capabilities of its own instead of the wrapped backend's."""

    capabilities = frozenset({Capability.PUSH_WAKEUP})


class _KeepsNothing(FaultyBackend):
    """Never lets the wrapped backend keep a grant."""

    def hold(
        self, name: str, owner: str, token: int, ended: Callable[[LossReason], object]
    ) -> None:
        return None


class _OwnEvents(FaultyBackend):
    """Tells its own observers, not the wrapped backend's."""

    @cached_property
    def events(self) -> Events:
        return Events()


class _ReleasesLate(AsyncioBridge):
    """Sends no early release (as the bridge once did)."""

    def release_now(self, name: str, owner: str, token: int) -> None:
        return None


MUTANTS: dict[str, tuple[Callable[[Recorder], Backend], list[str]]] = {
    "wait_turn": (_TurnIsAChange, ["wait_turn"]),
    "wait_permit_turn": (_PermitsPoll, ["wait_permit_turn"]),
    "renew_many": (_NoBatch, ["renews_many", "renew_many"]),
    "capabilities": (_ClassCapabilities, ["capabilities"]),
    "hold": (_KeepsNothing, ["hold"]),
    "release_now": (_ReleasesLate, ["release_now"]),
    "events": (_OwnEvents, ["events"]),
}


@pytest.mark.parametrize("mutant", MUTANTS.values(), ids=MUTANTS.keys())
async def test_a_dropped_forward_is_caught(
    anyio_backend: str, mutant: tuple[Callable[[Recorder], Backend], list[str]]
) -> None:
    make, dropped = mutant
    inner = Recorder()
    if make is _ReleasesLate:
        async with bridged():
            assert await gaps(make(inner), inner, far=False) == dropped
    else:
        assert await gaps(make(inner), inner, far=False) == dropped
