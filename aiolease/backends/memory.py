"""The in-memory backend: the reference model of the contract.

Every other backend is held against this one by the stateful model test. It is
exact, instant and single-process; its clock is injectable (by default
``anyio.current_time``, so trio's ``MockClock`` drives it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from .._clock import current_time
from .._exceptions import InvalidArgument, LossReason, NotOwnerError
from .._urls import redact, split_url
from ..abc import Backend, Capability, Grant, HolderInfo, Renewal, RenewedAsAsked, RenewResult

__all__ = ["MemoryBackend"]


@dataclass
class _Record:
    owner: str
    identity: str
    token: int
    metadata: dict[str, str]
    expires_at: float


#: The options :meth:`MemoryBackend.from_url` takes.
OPTIONS = ("clock",)


def _check_options(options: dict[str, Any]) -> dict[str, Any]:
    """:raises InvalidArgument: an option that is not in :data:`OPTIONS`"""
    for key in options:
        if key not in OPTIONS:
            raise InvalidArgument(
                f"memory backend option {key!r} is unknown; known: {', '.join(OPTIONS)}"
            )
    return options


class MemoryBackend(Backend):
    """Leases in a dict of this process.

    :param clock: returns the current time in seconds (default: the core's clock,
        ``anyio.current_time()`` read without its per-call look-ups)
    """

    capabilities = frozenset({Capability.PUSH_WAKEUP, Capability.SERVER_TIME})

    def __init__(self, *, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or current_time
        self._records: dict[str, _Record] = {}
        self._tokens: dict[str, int] = {}
        self._changed: dict[str, anyio.Event] = {}
        self._takers: dict[str, dict[object, tuple[str, int, Callable[[LossReason], object]]]] = {}

    def __repr__(self) -> str:
        return f"<MemoryBackend {len(self._records)} records>"

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> MemoryBackend:
        """``memory://`` (no host, path or query).

        :param options: ``clock`` (see the class)
        :raises InvalidArgument: another URL, or an unknown option
        """
        parts = split_url(url, "memory backend")
        if parts.scheme != "memory" or parts.netloc or parts.path not in ("", "/") or parts.query:
            raise InvalidArgument(f"a memory backend URL is just 'memory://', got {redact(url)!r}")
        return cls(**_check_options(options))

    def _live(self, name: str) -> _Record | None:
        record = self._records.get(name)
        if record is not None and record.expires_at <= self._clock():
            del self._records[name]
            self._changed_record(name)
            return None
        return record

    def _changed_record(self, name: str) -> None:
        """The record of ``name`` was granted anew or removed: wake who waits for that."""
        self._notify(name)
        takers = self._takers.get(name)
        if takers:
            record = self._records.get(name)
            for key, (owner, token, taken) in list(takers.items()):
                if record is None or (record.owner, record.token) != (owner, token):
                    del takers[key]
                    taken(LossReason.STOLEN)

    def _notify(self, name: str) -> None:
        event = self._changed.pop(name, None)
        if event is not None:
            event.set()

    def on_taken(
        self, name: str, owner: str, token: int, taken: Callable[[LossReason], object]
    ) -> Callable[[], None]:
        """Call ``taken(STOLEN)`` when ``name`` is released or granted to another."""
        key = object()
        takers = self._takers.setdefault(name, {})
        takers[key] = (owner, token, taken)

        def cancel() -> None:
            takers.pop(key, None)
            if not takers and self._takers.get(name) is takers:
                del self._takers[name]

        record = self._live(name)
        if record is None or (record.owner, record.token) != (owner, token):
            cancel()
            taken(LossReason.STOLEN)
        return cancel

    def _holder(self, name: str, record: _Record) -> HolderInfo:
        remaining = max(record.expires_at - self._clock(), 0.0)
        return HolderInfo(
            name, record.owner, record.identity, record.token, dict(record.metadata), remaining
        )

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        await anyio.lowlevel.checkpoint()
        record = self._live(name)
        if record is not None and record.owner != owner:
            return self._holder(name, record)
        if record is None:
            token = self._tokens[name] = self._tokens.get(name, 0) + 1
            record = self._records[name] = _Record(owner, identity, token, dict(metadata), 0.0)
            self._changed_record(name)
        record.expires_at = self._clock() + ttl
        return Grant(record.token, ttl)

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        await anyio.lowlevel.checkpoint()
        record = self._live(name)
        if record is None or record.owner != owner or record.token != token:
            raise NotOwnerError(name)
        record.expires_at = self._clock() + ttl
        return Grant(record.token, ttl)

    async def renew_many(self, renewals: Sequence[Renewal]) -> Sequence[RenewResult]:
        """Every lease due, in one call (as a server would answer one batch)."""
        await anyio.lowlevel.checkpoint()
        now = self._clock()
        records = self._records
        failed: dict[int, NotOwnerError] = {}
        for index, (name, owner, token, ttl) in enumerate(renewals):
            record = records.get(name)
            if record is not None and record.expires_at <= now:
                record = self._live(name)  # expired: dropped, and waiters told
            if record is None or record.owner != owner or record.token != token:
                failed[index] = NotOwnerError(name)
            else:
                record.expires_at = now + ttl
        return RenewedAsAsked(renewals, failed=failed)

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        await anyio.lowlevel.checkpoint()
        record = self._live(name)
        if record is None or record.owner != owner or (token is not None and record.token != token):
            return False
        del self._records[name]
        self._changed_record(name)
        return True

    async def read(self, name: str) -> HolderInfo | None:
        await anyio.lowlevel.checkpoint()
        record = self._live(name)
        return None if record is None else self._holder(name, record)

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        record = self._live(name)
        current = None if record is None else (record.owner, record.token)
        if current != (None if seen is None else (seen.owner, seen.token)):
            await anyio.lowlevel.checkpoint()
            return
        event = self._changed.setdefault(name, anyio.Event())
        if record is None:
            await event.wait()
            return
        with anyio.move_on_at(record.expires_at - self._clock() + anyio.current_time()):
            await event.wait()

    def force_release(self, name: str) -> None:
        """Drop ``name``'s record as an operator would (tests and tools)."""
        if self._records.pop(name, None) is not None:
            self._changed_record(name)
