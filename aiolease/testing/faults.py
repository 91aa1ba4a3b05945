"""A backend wrapper that injects faults, for testing loss detection.

Faults are set per operation and switched at run time::

    faulty = FaultyBackend(MemoryBackend())
    faulty.hang("renew")          # renewals never answer
    faulty.fail("renew", times=2) # the next two renewals raise BackendUnavailable
    faulty.delay("try_acquire", 0.5)
    faulty.lose_reply("try_acquire")  # the grant happens; the reply is lost
    faulty.slow_reply("try_acquire", 1.0)  # the grant happens; the reply comes late
    faulty.heal()

A session backend that keeps held grants itself (:meth:`Backend.hold`) is not renewed
by the core at all; set ``faulty.sessions = False`` to make the core renew through the
wrapper instead, so that faults on ``renew`` apply. Likewise a backend that reports
takeovers by callback (:meth:`Backend.on_taken`) is watched without ``read`` calls; set
``faulty.callbacks = False`` to make the core's takeover watch go through the wrapper.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import anyio

from .._exceptions import BackendTimeout, BackendUnavailable, InvalidArgument, LossReason
from ..abc import Backend, Grant, HolderInfo, SessionClock

__all__ = ["FaultyBackend", "Op"]

Op = Literal["try_acquire", "renew", "release", "read", "wait_changed", "wait_taken"]
OPS: frozenset[str] = frozenset(
    {"try_acquire", "renew", "release", "read", "wait_changed", "wait_taken"}
)
T = TypeVar("T")


@dataclass
class _Fault:
    kind: Literal["fail", "hang", "lose_reply", "delay", "slow_reply"]
    times: int | None = None
    seconds: float = 0.0


class FaultyBackend(Backend):
    """Wraps ``inner`` and misbehaves on command.

    :param inner: the backend that really stores the leases
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities  # type: ignore[misc]
        self.requires_asyncio = inner.requires_asyncio  # type: ignore[misc]
        self.poll_interval = inner.poll_interval
        #: Forward :meth:`hold` to ``inner`` (``False``: the core renews through here).
        self.sessions = True
        #: Forward :meth:`on_taken` to ``inner`` (``False``: the core's takeover watch
        #: calls :meth:`wait_taken` and :meth:`read` through here).
        self.callbacks = True
        self.calls: collections.Counter[str] = collections.Counter()
        self._faults: dict[str, _Fault] = {}
        self._called: dict[str, anyio.Event] = {}

    def __repr__(self) -> str:
        return f"<FaultyBackend {sorted(self._faults)} over {self.inner!r}>"

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> FaultyBackend:
        raise InvalidArgument("wrap a backend with FaultyBackend(inner); it has no URL")

    def _set(self, op: str, fault: _Fault) -> None:
        if op not in OPS:
            raise InvalidArgument(f"unknown operation {op!r}; one of {sorted(OPS)}")
        self._faults[op] = fault

    def fail(self, op: Op, *, times: int | None = None) -> None:
        """Make ``op`` raise :class:`BackendUnavailable` (``times`` times, or until healed)."""
        self._set(op, _Fault("fail", times))

    def hang(self, op: Op) -> None:
        """Make ``op`` never answer (until cancelled) without reaching the backend."""
        self._set(op, _Fault("hang"))

    def lose_reply(self, op: Op, *, times: int | None = None) -> None:
        """Make ``op`` reach the backend, then raise :class:`BackendTimeout`: a lost reply."""
        self._set(op, _Fault("lose_reply", times))

    def delay(self, op: Op, seconds: float) -> None:
        """Make ``op`` wait ``seconds`` before reaching the backend."""
        self._set(op, _Fault("delay", seconds=seconds))

    def slow_reply(self, op: Op, seconds: float) -> None:
        """Make ``op`` reach the backend at once, then hold its reply back ``seconds``."""
        self._set(op, _Fault("slow_reply", seconds=seconds))

    def heal(self, op: Op | None = None) -> None:
        """Remove the fault on ``op``, or all faults."""
        if op is None:
            self._faults.clear()
        else:
            self._faults.pop(op, None)

    async def wait_called(self, op: Op) -> None:
        """Wait until ``op`` is next called."""
        await self._called.setdefault(op, anyio.Event()).wait()

    async def _run(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        self.calls[op] += 1
        event = self._called.pop(op, None)
        if event is not None:
            event.set()
        fault = self._faults.get(op)
        if fault is None:
            return await call()
        if fault.times is not None:
            fault.times -= 1
            if fault.times <= 0:
                del self._faults[op]
        if fault.kind == "hang":
            await anyio.sleep_forever()
        if fault.kind == "fail":
            raise BackendUnavailable(f"injected failure of {op}")
        if fault.kind == "delay":
            await anyio.sleep(fault.seconds)
            return await call()
        result = await call()
        if fault.kind == "slow_reply":
            await anyio.sleep(fault.seconds)
            return result
        raise BackendTimeout(f"injected lost reply of {op}")

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        return await self._run(
            "try_acquire", lambda: self.inner.try_acquire(name, owner, ttl, identity, metadata)
        )

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        return await self._run("renew", lambda: self.inner.renew(name, owner, token, ttl))

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        return await self._run("release", lambda: self.inner.release(name, owner, token))

    async def read(self, name: str) -> HolderInfo | None:
        return await self._run("read", lambda: self.inner.read(name))

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        await self._run("wait_changed", lambda: self.inner.wait_changed(name, seen))

    async def wait_taken(self, name: str, held: HolderInfo) -> None:
        await self._run("wait_taken", lambda: self.inner.wait_taken(name, held))

    def hold(
        self, name: str, owner: str, token: int, ended: Callable[[LossReason], object]
    ) -> SessionClock | None:
        if not self.sessions:
            return None
        self.calls["hold"] += 1
        return self.inner.hold(name, owner, token, ended)

    def on_taken(
        self, name: str, owner: str, token: int, taken: Callable[[LossReason], object]
    ) -> Callable[[], None] | None:
        if not self.callbacks:
            return None
        self.calls["on_taken"] += 1
        return self.inner.on_taken(name, owner, token, taken)

    async def aclose(self) -> None:
        await self.inner.aclose()
