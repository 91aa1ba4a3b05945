"""The etcd backend's permits (semaphores and read-write locks,
``docs/internals/semaphores.md``, ``docs/internals/etcd.md#permits``): :class:`PermitOps`,
the part of :class:`~aiolease.backends.etcd.EtcdBackend` that serves them.

A key per permit and one per queued request under ``<prefix>%permits/<name>/``, in the
backend's session lease; the token is a permit key's create revision. Permits share the
backend's sessions, takeover watches, renewals and releases with its locks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from aetcd import rpc

from ..._exceptions import BackendUnavailable, LimitMismatchError, LossReason
from ..._permits import PermitHolders
from ...abc import Backend, Grant, HolderInfo
from .._asyncio import now
from ._keys import Layout, queue_slot
from ._permit_values import PermitKey, encode_permit, parse_permits
from ._session import QUEUE_HORIZON, SEEN_LIMIT, Entry, Session, Sessions
from ._takeover import Takeovers
from ._wire import SessionGone, Wire

__all__ = ["PermitOps"]

T = TypeVar("T")


class PermitOps(Backend):
    """The permit operations of an etcd backend; what they use of it is declared here
    and defined by :class:`~aiolease.backends.etcd.EtcdBackend`."""

    _wire: Wire
    _layout: Layout
    _sessions: Sessions
    _takeovers: Takeovers
    #: Per refused permit request: what its wait needs (see :class:`_Turn`).
    _permit_seen: dict[tuple[str, str], _Turn]

    if TYPE_CHECKING:  # defined by EtcdBackend

        def _check_open(self) -> None: ...

        async def _guarded(self, name: str, owner: str, attempt: Coroutine[Any, Any, T]) -> T: ...

        def _grant(self, token: int, ttl: float, session: Session) -> Grant: ...

        def _granted(self, entry: Entry, ttl: float, touched: float) -> Grant: ...

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
        """Read the name's permit keys; grant ``owner``'s if the weights of the keys
        before it and its own fit in ``limit``, else queue it (a key of its own).

        A new key is put by a txn that fails if another key of the name was created
        since the read (etcd's compares cannot sum weights): then it decides again."""
        self._check_open()
        touched = now()
        for _ in range(8):
            async with self._sessions.using(ttl) as session:
                try:
                    attempt = self._acquire_permit(
                        name, owner, ttl, (identity, metadata, limit, weight), session, touched
                    )
                    result = await self._guarded(name, owner, attempt)
                except SessionGone:
                    self._sessions.lose(session)
                    continue
            if result is not None:
                return result
        raise BackendUnavailable(f"etcd: the permits of {name!r} kept changing; try again")

    async def _acquire_permit(
        self,
        name: str,
        owner: str,
        ttl: float,
        request: tuple[str, Mapping[str, str], int, int],
        session: Session,
        touched: float,
    ) -> Grant | HolderInfo | None:
        """One attempt; ``None``: the keys changed under it (decide again)."""
        identity, metadata, limit, weight = request
        start = self._layout.permit_start(name)
        # First as if the name had no key: the put's guard ("no key created before
        # revision 1") checks that on the server, and its failure answers with the keys.
        # An uncontended acquire is then one round trip, not a range and a txn.
        kvs: Sequence[Any] = ()
        revision = 0
        lost = 0  # puts of a permit key that lost the race to another request's key
        for _ in range(8):
            self._check_open()
            keys = parse_permits(name, start, kvs)
            for key in keys:
                if key.limit != limit:
                    raise LimitMismatchError(name, limit, key.limit)
            used = sum(key.weight for key in keys if not key.queued)
            ahead, mine = 0, None
            for key in keys:
                if key.owner == owner:
                    mine = key
                    if not key.queued:
                        break
                elif key.queued and (mine is None or not mine.queued):
                    ahead += key.weight
            if mine is not None and not mine.queued:  # a retry by the holder
                return await self._regrant_permit(name, owner, ttl, mine, session, touched)
            fits = used + ahead + weight <= limit
            if mine is not None:
                if (name, owner, mine.token) in self._sessions.doomed:
                    self._note_turn(name, owner, _Turn(revision, 0, mine.token))
                    return _blocker(name, keys, owner)  # expired here; being deleted
                if fits:  # its turn: held with what it asks now
                    value = encode_permit(identity, metadata, limit, weight, False)
                    return await self._grant_queued(name, owner, ttl, mine, value, session, touched)
                if not await self._keep_queued(name, owner, ttl, mine, session, touched):
                    return None
                self._note_turn(
                    name, owner, _Turn(revision, used + ahead + weight - limit, mine.token)
                )
                return _blocker(name, keys, owner)
            # Granted: no key may have come since the read (a new permit, or a queue key
            # that its weight would have to count). Queued: keys that came since are behind
            # it; while a key of the read stays, each of them was checked against its limit
            # (every request's key is put only while a key of its own read stays). A
            # request that fits but lost the race twice queues instead, and takes its turn
            # by its queue key (as a refused one does): under a storm of requests a race
            # for a free permit could otherwise be lost every time, until it gave up.
            grant = fits and (lost < 2 or not keys)
            guard = ("newer", revision) if grant or not keys else _lasting(keys)
            slot = owner if grant else queue_slot(owner)
            value = encode_permit(identity, metadata, limit, weight, not grant)
            put = await self._wire.txn(
                self._layout.permit_put(name, slot, value, session.lease_id, guard)
            )
            self._check_open()
            if not put.succeeded:
                lost += grant and revision > 0  # (not the first, blind try)
                kvs = put.responses[0].response_range.kvs
                revision = int(put.header.revision)
                continue
            token = int(put.header.revision)
            if grant:
                entry = Entry(name, owner, token, session, touched + ttl)
                self._sessions.attach(entry)
                self._takeovers.watch(entry)
                return self._grant(token, ttl, session)
            horizon = touched + QUEUE_HORIZON * ttl
            queued = Entry(name, owner, token, session, horizon, queued=True, slot=slot)
            self._sessions.attach(queued)
            if not fits:
                self._note_turn(name, owner, _Turn(revision, used + ahead + weight - limit, token))
                return _blocker(name, keys, owner)
            reply = await self._wire.range(self._layout.permits(name))  # its turn yet?
            kvs, revision = reply.kvs, int(reply.header.revision)
        return None

    async def _regrant_permit(
        self, name: str, owner: str, ttl: float, key: PermitKey, session: Session, touched: float
    ) -> Grant | None:
        """``owner`` holds ``key``: its grant again, its key on ``session``."""
        if key.lease != session.lease_id:
            moved = await self._wire.txn(
                self._layout.move(name, owner, key.token, session.lease_id)
            )
            if not moved.succeeded:
                return None
        entry = self._sessions.entries.get((name, owner))
        if entry is None or entry.token != key.token:
            entry = Entry(name, owner, key.token, session, touched + ttl)
            self._sessions.attach(entry)
        elif entry.session is not session:
            self._sessions.move(entry, session)
        return self._granted(entry, ttl, touched)

    async def _grant_queued(
        self,
        name: str,
        owner: str,
        ttl: float,
        key: PermitKey,
        value: bytes,
        session: Session,
        touched: float,
    ) -> Grant | None:
        """``owner``'s queued ``key`` fits: replace it by a permit key (a new token)."""
        request = self._layout.permit_grant(name, owner, key.token, value, session.lease_id)
        reply = await self._wire.txn(request)
        if not reply.succeeded:
            return None
        old = self._sessions.entries.get((name, owner))
        if old is not None:
            self._sessions.end(old, LossReason.RELEASED)  # its queue key is deleted
        entry = Entry(name, owner, int(reply.header.revision), session, touched + ttl)
        self._sessions.attach(entry)
        return self._granted(entry, ttl, touched)

    async def _keep_queued(
        self, name: str, owner: str, ttl: float, key: PermitKey, session: Session, touched: float
    ) -> bool:
        """``owner``'s queued ``key`` stays: push its horizon back (on ``session``, moving
        it there if it rides on another); ``False`` if it is gone."""
        horizon = touched + QUEUE_HORIZON * ttl
        entry = self._sessions.entries.get((name, owner))
        if entry is not None and entry.token == key.token and entry.session is session:
            entry.horizon = max(entry.horizon, horizon)
            return True
        if key.lease != session.lease_id:
            request = self._layout.move(name, key.slot, key.token, session.lease_id)
            if not (await self._wire.txn(request)).succeeded:
                return False
        if entry is None or entry.token != key.token:
            queued = Entry(name, owner, key.token, session, horizon, queued=True, slot=key.slot)
            self._sessions.attach(queued)
        else:
            self._sessions.move(entry, session)
            entry.horizon = max(entry.horizon, horizon)
        return True

    async def read_permits(self, name: str) -> PermitHolders | None:
        self._check_open()
        reply = await self._wire.range(self._layout.permits(name))
        keys = parse_permits(name, self._layout.permit_start(name), reply.kvs)
        if not keys:
            return None
        held = [key for key in keys if not key.queued]
        holders = tuple(key.holder(name) for key in held)
        weights = tuple(key.weight for key in held)
        return PermitHolders(name, keys[0].limit, holders, weights, len(keys) - len(held))

    def _note_turn(self, name: str, owner: str, turn: _Turn) -> None:
        if len(self._permit_seen) >= SEEN_LIMIT:
            del self._permit_seen[next(iter(self._permit_seen))]
        self._permit_seen[(name, owner)] = turn

    async def wait_permit_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Watch the name's permit keys from the refused request's read until the weight
        that blocks it is gone (permits released or lost, queue keys ahead of it gone
        without a grant), or its own queue key is; at most a third of ``ttl``. Only
        the waiters whose turn may have come wake, not every waiter at every release."""
        self._check_open()
        turn = self._permit_seen.pop((name, owner), None)
        if turn is None:
            return
        entry = self._sessions.entries.get((name, owner))
        if entry is not None and entry.queued:
            entry.horizon = max(entry.horizon, now() + QUEUE_HORIZON * ttl)
        if turn.deficit <= 0:
            return
        watch = self._wire.watch(self._layout.watch_permits(name, turn.revision), turn.accept)
        try:
            await asyncio.wait_for(watch, ttl / 3)
        except TimeoutError:
            pass


@dataclass
class _Turn:
    """A refused permit request's wait: from the ``revision`` of its read, the weight
    by which it did not fit (``deficit``), and its queue key's create revision
    (``mine``). Events after the read change the deficit: a new permit key adds its
    weight, as does a new queue key ahead of ``mine``; a deleted permit key, or a deleted
    queue key ahead of it, takes its weight off (a grant deletes a queue key and puts a
    permit key in one revision: no change)."""

    revision: int
    deficit: int
    mine: int

    def accept(self, event: Any) -> bool:
        """Whether ``event`` (a watch event, with its previous key-value) ends the wait."""
        deleted: bool = event.type == rpc.Event.DELETE
        kv = event.prev_kv if deleted else event.kv
        if kv.create_revision == self.mine:
            return deleted  # its own queue key: gone (ask again), or its own put
        if not deleted and kv.create_revision != kv.mod_revision:
            return False  # a key moved to another lease, or refreshed: no weight changed
        try:
            document = json.loads(kv.value)
            weight, queued = int(document["weight"]), bool(document["queued"])
        except (ValueError, KeyError, TypeError):
            return True  # not a value aiolease writes: let the next try report it
        if queued and kv.create_revision > self.mine:
            return False  # behind it
        self.deficit += -weight if deleted else weight
        return self.deficit <= 0


def _lasting(keys: list[PermitKey]) -> tuple[str, int]:
    """The guard of a queue key's put: the key of ``keys`` likely to stay longest, the
    newest queued one (at the back of the queue), else the newest permit. (The oldest
    permit, the first to be released, made every queued put fail while holders came and
    went every millisecond, until the request gave up.)"""
    queued = [key for key in keys if key.queued]
    last = (queued or keys)[-1]
    return (last.slot, last.token)


def _blocker(name: str, keys: list[PermitKey], owner: str) -> HolderInfo:
    """Who blocks ``owner``'s permit request: the oldest held permit, else the first
    queued request (token 0)."""
    for key in keys:
        if not key.queued and key.owner != owner:
            return key.holder(name)
    for key in keys:
        if key.owner != owner:
            return key.holder(name, 0)
    return HolderInfo(name, owner, "", 0, {}, None)
