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

from .._checked import derived, returns_within_ttl
from .._clock import checkpoint, current_time, event, move_on_after
from .._exceptions import InvalidArgument, LimitMismatchError, LossReason, NotOwnerError
from .._records import state_of
from .._urls import redact, split_url
from ..abc import (
    Backend,
    Capability,
    Grant,
    HolderInfo,
    PermitHolders,
    Renewal,
    RenewedAsAsked,
    RenewResult,
    is_permit_owner,
)

__all__ = ["MemoryBackend"]


@dataclass
class _Record:
    owner: str
    identity: str
    token: int
    metadata: dict[str, str]
    expires_at: float


@dataclass
class _Queued:
    """A refused permit request, queued until its ttl runs out without a retry."""

    weight: int
    identity: str
    expires_at: float


@dataclass
class _Permits:
    """The permits of one name: held (in grant order) and queued (in arrival order)."""

    limit: int
    held: dict[str, tuple[_Record, int]]  # owner -> (record, weight)
    queue: dict[str, _Queued]


def _fits(state: _Permits, owner: str, weight: int) -> bool:
    """Rule 3: the held weight, the weight queued ahead of ``owner`` and ``weight`` fit
    in the limit."""
    # (Plain loops: this runs on every request and every wait of a permit.)
    used = weight
    for _, held in state.held.values():
        used += held
    for other, entry in state.queue.items():
        if other == owner:
            break
        used += entry.weight
    return used <= state.limit


#: What the wake-ups of a name's permits are keyed by, before the name (apart from
#: the lock's: a name never holds NUL).
PERMITS_KEY = "\x00permits:"


def _turn_key(name: str, owner: str) -> str:
    """The key of the event that wakes the waiter ``owner`` of ``name``'s permits."""
    return f"{PERMITS_KEY}{name}\x00{owner}"


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


def _locks_only(renewals: Sequence[Renewal]) -> bool:
    """Whether no renewal of ``renewals`` is a permit's."""
    return not any(is_permit_owner(owner) for _, owner, _, _ in renewals)


class MemoryBackend(Backend):
    """Leases in a dict of this process.

    :param clock: returns the current time in seconds (default: the core's clock,
        ``anyio.current_time()`` read without its per-call look-ups)
    """

    capabilities = frozenset(
        {
            Capability.PUSH_WAKEUP,
            Capability.SERVER_TIME,
            Capability.PROCLAIM,
            Capability.SEMAPHORE,
            Capability.FAIR_PERMITS,
            Capability.PERMIT_RETRY_KEEPS_ENTRY,
        }
    )

    def __init__(self, *, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or current_time
        self._records: dict[str, _Record] = {}
        self._tokens: dict[str, int] = {}
        self._changed: dict[str, anyio.Event] = {}
        self._takers: dict[str, dict[object, tuple[str, int, Callable[[LossReason], object]]]] = {}
        self._permits: dict[str, _Permits] = {}
        #: The owners in :meth:`wait_permit_turn` now, by name.
        self._permit_waiting: dict[str, set[str]] = {}
        self._permit_tokens: dict[str, int] = {}
        self._permit_takers: dict[
            str, dict[object, tuple[str, int, Callable[[LossReason], object]]]
        ] = {}

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
        changed = self._changed.pop(name, None)
        if changed is not None:
            changed.set()

    def on_taken(
        self, name: str, owner: str, token: int, taken: Callable[[LossReason], object]
    ) -> Callable[[], None]:
        """Call ``taken(STOLEN)`` when ``name`` is released or granted to another (a
        permit: when it is gone)."""
        if is_permit_owner(owner):
            return self._on_permit_taken(name, owner, token, taken)
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
        await checkpoint()
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
        await checkpoint()
        if is_permit_owner(owner):
            return self._renew_permit(name, owner, token, ttl)
        record = self._live(name)
        if record is None or record.owner != owner or record.token != token:
            raise NotOwnerError(name)
        record.expires_at = self._clock() + ttl
        return Grant(record.token, ttl)

    async def renew_many(self, renewals: Sequence[Renewal]) -> Sequence[RenewResult]:
        """Every lease due, in one call (as a server would answer one batch)."""
        await checkpoint()
        now = self._clock()
        records = self._records
        failed: dict[int, NotOwnerError] = {}
        if derived(renewals, "memory-locks", _locks_only):  # (usually: no permit to tell)
            for index, (name, owner, token, ttl) in enumerate(renewals):
                record = records.get(name)
                if record is not None and record.expires_at <= now:
                    record = self._live(name)  # expired: dropped, and waiters told
                if record is None or record.owner != owner or record.token != token:
                    failed[index] = NotOwnerError(name)
                else:
                    record.expires_at = now + ttl
            return RenewedAsAsked(renewals, failed=failed)
        for index, (name, owner, token, ttl) in enumerate(renewals):
            if is_permit_owner(owner):
                try:
                    self._renew_permit(name, owner, token, ttl)  # a grant as asked
                except NotOwnerError as exc:
                    failed[index] = exc
                continue
            record = records.get(name)
            if record is not None and record.expires_at <= now:
                record = self._live(name)  # expired: dropped, and waiters told
            if record is None or record.owner != owner or record.token != token:
                failed[index] = NotOwnerError(name)
            else:
                record.expires_at = now + ttl
        return RenewedAsAsked(renewals, failed=failed)

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        await checkpoint()
        if is_permit_owner(owner):
            return self._release_permit(name, owner, token)
        record = self._live(name)
        if record is None or record.owner != owner or (token is not None and record.token != token):
            return False
        del self._records[name]
        self._changed_record(name)
        return True

    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        await checkpoint()
        record = self._live(name)
        if record is None or record.owner != owner or record.token != token:
            raise NotOwnerError(name)
        record.metadata = dict(metadata)
        self._notify(name)  # the holder is the same: no takeover to report

    async def read(self, name: str) -> HolderInfo | None:
        await checkpoint()
        record = self._live(name)
        return None if record is None else self._holder(name, record)

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        record = self._live(name)
        current = None if record is None else self._holder(name, record)
        if state_of(current) != state_of(seen):
            await checkpoint()
            return
        changed = self._changed.get(name)
        if changed is None:
            changed = self._changed[name] = event()
        if record is None:
            await changed.wait()
            return
        with move_on_after(record.expires_at - self._clock()):
            await changed.wait()

    def force_release(self, name: str) -> None:
        """Drop ``name``'s record as an operator would (tests and tools)."""
        if self._records.pop(name, None) is not None:
            self._changed_record(name)

    # -- permits (docs/internals/semaphores.md) -----------------------------------------

    def _live_permits(self, name: str) -> _Permits | None:
        """The permits of ``name`` with expired ones and queue entries dropped (and who
        waits told), or ``None`` when none is left."""
        state = self._permits.get(name)
        if state is None:
            return None
        now = self._clock()
        gone = False  # (loops, not lists: nothing has expired, nearly always)
        for record, _ in state.held.values():
            if record.expires_at <= now:
                gone = True
                break
        for queued in state.queue.values():
            if queued.expires_at <= now:
                gone = True
                break
        if not gone and (state.held or state.queue):
            return state
        expired = [owner for owner, (record, _) in state.held.items() if record.expires_at <= now]
        lapsed = [owner for owner, queued in state.queue.items() if queued.expires_at <= now]
        for owner in expired:
            del state.held[owner]
        for owner in lapsed:
            del state.queue[owner]
        if not state.held and not state.queue:
            del self._permits[name]
        if expired or lapsed:
            self._permits_changed(name)
        return self._permits.get(name)

    def _permits_changed(self, name: str) -> None:
        """A permit or queue entry of ``name`` is gone: wake who waits, tell who watches."""
        self._notify_permits(name)
        takers = self._permit_takers.get(name)
        if takers:
            state = self._permits.get(name)
            for key, (owner, token, taken) in list(takers.items()):
                held = None if state is None else state.held.get(owner)
                if held is None or held[0].token != token:
                    del takers[key]
                    taken(LossReason.STOLEN)

    def _notify_permits(self, name: str) -> None:
        """Wake the waiters of ``name`` whose requests fit now (in arrival order: the
        first that does not fit stops it) or that are queued no more; the others sleep
        on (each woken waiter asks again, and only one may fit)."""
        waiting = self._permit_waiting.get(name)
        if not waiting:
            return
        state = self._permits.get(name)
        if state is not None:
            used = 0
            for _, weight in state.held.values():
                used += weight
            for owner, queued in state.queue.items():
                used += queued.weight
                if used > state.limit:
                    break
                if owner in waiting:
                    self._notify(_turn_key(name, owner))
        for owner in list(waiting):
            if state is None or owner not in state.queue:
                self._notify(_turn_key(name, owner))

    def _on_permit_taken(
        self, name: str, owner: str, token: int, taken: Callable[[LossReason], object]
    ) -> Callable[[], None]:
        key = object()
        takers = self._permit_takers.setdefault(name, {})
        takers[key] = (owner, token, taken)

        def cancel() -> None:
            takers.pop(key, None)
            if not takers and self._permit_takers.get(name) is takers:
                del self._permit_takers[name]

        state = self._live_permits(name)
        held = None if state is None else state.held.get(owner)
        if held is None or held[0].token != token:
            cancel()
            taken(LossReason.STOLEN)
        return cancel

    def _permit_holder(self, name: str, owner: str, record: _Record) -> HolderInfo:
        remaining = max(record.expires_at - self._clock(), 0.0)
        return HolderInfo(
            name, owner, record.identity, record.token, dict(record.metadata), remaining
        )

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
        """Grant if the held weight, the weight queued ahead and ``weight`` fit in
        ``limit``; else queue ``owner`` (in arrival order) and report who blocks."""
        await checkpoint()
        state = self._live_permits(name)
        if state is not None and state.limit != limit:
            raise LimitMismatchError(name, limit, state.limit)
        if state is None:
            state = self._permits[name] = _Permits(limit, {}, {})
        now = self._clock()
        mine = state.held.get(owner)
        if mine is not None:  # a retry by the holder
            mine[0].expires_at = now + ttl
            return Grant(mine[0].token, ttl)
        if _fits(state, owner, weight):
            state.queue.pop(owner, None)
            token = self._permit_tokens[name] = self._permit_tokens.get(name, 0) + 1
            record = _Record(owner, identity, token, dict(metadata), now + ttl)
            state.held[owner] = (record, weight)
            return Grant(token, ttl)
        queued = state.queue.get(owner)
        if queued is None:
            state.queue[owner] = _Queued(weight, identity, now + ttl)
        else:
            queued.expires_at = now + ttl
        if state.held:
            first: _Record | None = None  # the first to expire
            for record, _ in state.held.values():
                if first is None or record.expires_at < first.expires_at:
                    first = record
            assert first is not None
            return self._permit_holder(name, first.owner, first)
        first_owner, head = next(iter(state.queue.items()))
        return HolderInfo(name, first_owner, head.identity, 0, {}, max(head.expires_at - now, 0.0))

    def _renew_permit(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        state = self._live_permits(name)
        held = None if state is None else state.held.get(owner)
        if held is None or held[0].token != token:
            raise NotOwnerError(name)
        held[0].expires_at = self._clock() + ttl
        return Grant(token, ttl)

    def _release_permit(self, name: str, owner: str, token: int | None) -> bool:
        state = self._live_permits(name)
        if state is None:
            return False
        held = state.held.get(owner)
        freed = held is not None and (token is None or held[0].token == token)
        if freed:
            del state.held[owner]
        dequeued = state.queue.pop(owner, None) is not None
        if not state.held and not state.queue:
            del self._permits[name]
        if freed or dequeued:
            self._permits_changed(name)
        return freed

    async def read_permits(self, name: str) -> PermitHolders | None:
        await checkpoint()
        state = self._live_permits(name)
        if state is None:
            return None
        holders = tuple(self._permit_holder(name, o, r) for o, (r, _) in state.held.items())
        weights = tuple(w for _, w in state.held.values())
        return PermitHolders(name, state.limit, holders, weights, len(state.queue))

    def _permit_wait(self, name: str, owner: str, ttl: float) -> float | None:
        """How long a refused ``owner`` may wait for a change before it retries (the
        first expiry among the name's permits and queue entries, at most a third of
        ``ttl``), or ``None`` if it should retry at once: it is not queued, or its
        request fits now (what blocked it went between the refusal and this wait)."""
        state = self._live_permits(name)
        if state is None or owner not in state.queue:
            return None
        if _fits(state, owner, state.queue[owner].weight):
            return None
        now = self._clock()
        until = now + ttl / 3
        for record, _ in state.held.values():
            if record.expires_at < until:
                until = record.expires_at
        for queued in state.queue.values():
            if queued.expires_at < until:
                until = queued.expires_at
        return until - now

    @returns_within_ttl  # (at most a third of it)
    async def wait_permit_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Return when a permit or queue entry of ``name`` is gone, or the first of them
        expires, or after a third of ``ttl`` (so that the retry keeps the place)."""
        seconds = self._permit_wait(name, owner, ttl)
        if seconds is None:
            await checkpoint()
            return
        key = self._start_waiting(name, owner)
        try:
            changed = self._changed.get(key)
            if changed is None:
                changed = self._changed[key] = event()
            try:
                with move_on_after(seconds):
                    await changed.wait()
            finally:
                if self._changed.get(key) is changed:
                    del self._changed[key]  # not woken: no event left behind
        finally:
            self._stop_waiting(name, owner)

    def _start_waiting(self, name: str, owner: str) -> str:
        """``owner`` waits for its turn on ``name``'s permits from now on (until
        :meth:`_stop_waiting`): the key that :meth:`_notify` wakes it by. (Not a context
        manager: this runs on every wait of a permit.)"""
        waiting = self._permit_waiting.get(name)
        if waiting is None:
            waiting = self._permit_waiting[name] = set()
        waiting.add(owner)
        return _turn_key(name, owner)

    def _stop_waiting(self, name: str, owner: str) -> None:
        """``owner`` waits for its turn on ``name``'s permits no more."""
        waiting = self._permit_waiting.get(name)
        if waiting is not None:
            waiting.discard(owner)
            if not waiting:
                del self._permit_waiting[name]

    def force_release_permits(self, name: str) -> None:
        """Drop every permit and queue entry of ``name`` as an operator would (tests)."""
        if self._permits.pop(name, None) is not None:
            self._permits_changed(name)
