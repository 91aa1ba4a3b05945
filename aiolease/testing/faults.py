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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

import anyio

from .._exceptions import BackendTimeout, BackendUnavailable, InvalidArgument
from ..abc import Backend, WrappingBackend

__all__ = ["FaultyBackend", "Op"]

Op = Literal[
    "try_acquire",
    "renew",
    "renew_many",
    "release",
    "read",
    "wait_changed",
    "wait_taken",
    "wait_turn",
    "wait_lost",
    "update_metadata",
    "try_acquire_permit",
    "read_permits",
    "wait_permit_turn",
]
OPS: frozenset[str] = frozenset(get_args(Op))
T = TypeVar("T")
#: Operations that a fault set on another one also hits, unless set on themselves, and
#: that :meth:`FaultyBackend.wait_called` of the other one also sees: a batch of
#: renewals (a backend that :attr:`~Backend.renews_many`) as a whole, and
#: :meth:`~Backend.wait_turn`, which the default makes a wait_changed.
_ALSO = {"renew_many": "renew", "wait_turn": "wait_changed"}


@dataclass
class _Fault:
    kind: Literal["fail", "hang", "lose_reply", "delay", "slow_reply"]
    times: int | None = None
    seconds: float = 0.0


class FaultyBackend(WrappingBackend):
    """Wraps ``inner`` and misbehaves on command.

    Every operation of the contract is ``inner``'s (a :class:`WrappingBackend`), each
    awaited one subject to the faults set on it (:data:`Op`), and counted in
    :attr:`calls` with the plain hooks it forwards.

    :param inner: the backend that really stores the leases
    """

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.requires_asyncio = inner.requires_asyncio  # type: ignore[misc]
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

    def called(self, op: Op) -> anyio.Event:
        """An event set when ``op`` is next called, watched from now on: a call made
        before anyone waits on it still sets it (a task that calls :meth:`wait_called`
        starts watching only once it runs)."""
        return self._called.setdefault(op, anyio.Event())

    async def wait_called(self, op: Op) -> None:
        """Wait until ``op`` is next called (after this task starts waiting; see
        :meth:`called` to watch from an earlier point)."""
        await self.called(op).wait()

    async def _run(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        self.calls[op] += 1
        for called in {op, _ALSO.get(op, op)}:
            event = self._called.pop(called, None)
            if event is not None:
                event.set()
        key = op if op in self._faults else _ALSO.get(op, op)
        fault = self._faults.get(key)
        if fault is None:
            return await call()
        if fault.times is not None:
            fault.times -= 1
            if fault.times <= 0:
                del self._faults[key]
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

    async def _forward(self, op: str, *args: Any) -> Any:
        """``inner``'s ``op``, subject to the fault set on it."""
        return await self._run(op, lambda: super(FaultyBackend, self)._forward(op, *args))

    def _forward_now(self, op: str, *args: Any) -> Any:
        """``inner``'s plain hook ``op``, unless switched off: :meth:`hold` while
        :attr:`sessions` is off, :meth:`on_taken` while :attr:`callbacks` is, and
        :meth:`release_now` while a fault is set on ``release`` (the core then calls
        :meth:`release`, where the fault is)."""
        off = {"hold": not self.sessions, "on_taken": not self.callbacks}
        if off.get(op, False) or (op == "release_now" and "release" in self._faults):
            return None
        self.calls[op] += 1
        return super()._forward_now(op, *args)
