"""The etcd backend's permits (semaphores and read-write locks,
``docs/internals/semaphores.md``, ``docs/internals/etcd.md#permits``): :class:`PermitOps`,
the part of :class:`~aiolease.backends.etcd.EtcdBackend` that serves them.

A key per permit and one per queued request under ``<prefix>%permits/<name>/``, in the
backend's session lease; the token is a permit key's create revision. Each request
writes its keys in a slot of this backend's (:meth:`EtcdBackend._take_slot`), reused by
later requests once its keys are seen deleted, and its value names the owner. Permits
share the backend's sessions, takeover watches, renewals and releases with its locks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..._exceptions import BackendUnavailable, LimitMismatchError, LossReason
from ..._permits import PermitHolders
from ...abc import Backend, Grant, HolderInfo
from .._asyncio import now
from . import _encoded as encoded
from ._keys import Layout, queue_slot
from ._permit_turn import Turn
from ._permit_values import PermitKey, encode_permit, parse_permits
from ._permit_watch import PermitWatches
from ._session import QUEUE_HORIZON, SEEN_LIMIT, Entry, Session, Sessions
from ._takeover import Takeovers
from ._wire import SessionGone, Wire

__all__ = ["PermitOps"]

T = TypeVar("T")

#: Requests a release's hand-off may go to, one after the other (see
#: :meth:`PermitOps._hand_permit`): more than the hand-offs of a name under way at once.
HANDOFF_BRANCHES = 6
#: Compares a hand-off's cascade may hold (etcd refuses a txn of more than 128
#: operations at any level, nested ones counted with those around them).
HANDOFF_COMPARES = 96


class PermitOps(Backend):
    """The permit operations of an etcd backend; what they use of it is declared here
    and defined by :class:`~aiolease.backends.etcd.EtcdBackend`."""

    _wire: Wire
    _layout: Layout
    _sessions: Sessions
    _takeovers: Takeovers
    _permit_watches: PermitWatches
    #: Per refused permit request: what its wait needs (see :class:`Turn`).
    _permit_seen: dict[tuple[str, str], Turn]
    #: The permit requests queued through this backend that wait for their turn (or
    #: waited, and ask again), by name and owner, each as its latest :class:`Turn`: a
    #: release here may hand its place to the first of them (:meth:`_hand_permit`).
    #: Only a request that waits: one refused by ``acquire_nowait`` never gets a grant
    #: it did not ask for.
    _permit_queued: dict[str, dict[str, Turn]]
    #: Grants handed to waiting requests by a release here, by (name, owner): the token,
    #: taken by the request's next attempt without a request.
    _permit_handed: dict[tuple[str, str], int]
    #: Requests whose wait found, from the watch, that they fit now, by (name, owner):
    #: the next attempt replaces the queue key by a permit key without reading first.
    _permit_ready: dict[tuple[str, str], Turn]

    if TYPE_CHECKING:  # defined by EtcdBackend

        def _check_open(self) -> None: ...

        async def _guarded(self, name: str, owner: str, attempt: Coroutine[Any, Any, T]) -> T: ...

        def _grant(self, token: int, ttl: float, session: Session) -> Grant: ...

        def _granted(self, entry: Entry, ttl: float, touched: float) -> Grant: ...

        def _take_slot(self, name: str, owner: str) -> str: ...

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
        handed = self._permit_handed.pop((name, owner), None) if self._permit_handed else None
        if handed is not None:
            self._forget_queued(name, owner)
            entry = self._sessions.entries.get((name, owner))
            if (
                entry is not None
                and entry.token == handed
                and entry.reason is None
                and entry.session.usable(touched)
            ):
                return self._granted(entry, ttl, touched)
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
        slot = self._take_slot(name, owner)  # its keys' (the one it has, if any)
        held = encode_permit(identity, metadata, limit, weight, False, owner)
        ready = self._permit_ready.pop((name, owner), None) if self._permit_ready else None
        if ready is not None:
            # Its wait counted, from the watch, that it fits now: no read needed (it
            # keeps fitting while its queue key lives: every grant since counted it).
            place = (ready.slot, ready.mine, ready.weight)
            granted = await self._grant_queued(name, owner, ttl, place, held, session, touched)
            if granted is not None:
                return granted
        # First as if the name had no key: the put's guard ("no key created before
        # revision 1") checks that on the server, and its failure answers with the keys.
        # An uncontended acquire is then one round trip, not a range and a txn.
        kvs: Sequence[Any] = ()
        revision = 0
        if self._permit_queued.get(name):
            # Requests of the name are queued here: its keys exist, the blind put would fail.
            # Queue it at once, behind a request queued here with its limit (every key
            # created since that one's was checked against it), and read the keys in the
            # same txn: a refusal is one round trip (it was a read, then the txn). The
            # decision below is made from what it read, its own queue key among the keys.
            kvs, revision = await self._enqueue_permit(
                name, owner, slot, ttl, request, session, touched
            )
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
                    self._note_turn(name, owner, Turn(revision, 0, mine.token), False)
                    return _blocker(name, keys, owner)  # expired here; being deleted
                if fits:  # its turn: held with what it asks now
                    place = (mine.permit_slot, mine.token, mine.weight)
                    return await self._grant_queued(name, owner, ttl, place, held, session, touched)
                if not await self._keep_queued(name, owner, ttl, mine, session, touched):
                    return None
                deficit = used + ahead + weight - limit
                slot = mine.permit_slot
                turn = Turn(
                    revision, deficit, mine.token, owner, weight, held, ttl, limit=limit, slot=slot
                )
                self._note_turn(name, owner, turn)
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
            at = slot if grant else queue_slot(slot)
            value = held if grant else encode_permit(identity, metadata, limit, weight, True, owner)
            put = await self._wire.txn(
                self._layout.permit_put(name, at, value, session.lease_id, guard)
            )
            self._check_open()
            if not put.succeeded:
                lost += grant and revision > 0  # (not the first, blind try)
                kvs = put.responses[0].response_range.kvs
                revision = int(put.header.revision)
                continue
            token = int(put.header.revision)
            if grant:
                entry = Entry(name, owner, token, session, touched + ttl, slot=slot, weight=weight)
                self._sessions.attach(entry)
                self._takeovers.watch(entry)
                return self._grant(token, ttl, session)
            horizon = touched + QUEUE_HORIZON * ttl
            queued = Entry(name, owner, token, session, horizon, queued=True, slot=at)
            self._sessions.attach(queued)
            if not fits:
                deficit = used + ahead + weight - limit
                turn = Turn(
                    revision, deficit, token, owner, weight, held, ttl, limit=limit, slot=slot
                )
                self._note_turn(name, owner, turn)
                return _blocker(name, keys, owner)
            reply = await self._wire.range(self._layout.permits(name))  # its turn yet?
            kvs, revision = reply.kvs, int(reply.header.revision)
        return None

    async def _enqueue_permit(
        self,
        name: str,
        owner: str,
        slot: str,
        ttl: float,
        request: tuple[str, Mapping[str, str], int, int],
        session: Session,
        touched: float,
    ) -> tuple[Sequence[Any], int]:
        """Queue ``owner``'s request (its keys in ``slot``) unless it has a key already,
        guarded on the newest queue key of a request queued here with its limit
        (:meth:`Layout.permit_enqueue`); the name's keys and the revision they were read
        at. Only a read when no such request is queued here."""
        identity, metadata, limit, weight = request
        turns = [t for t in self._permit_queued.get(name, {}).values() if t.limit == limit]
        if not turns:
            reply = await self._wire.range(self._layout.permits(name))
            return reply.kvs, int(reply.header.revision)
        last = max(turns, key=lambda turn: turn.mine)
        guard = (queue_slot(last.slot), last.mine)
        value = encode_permit(identity, metadata, limit, weight, True, owner)
        put = await self._wire.txn(
            self._layout.permit_enqueue(name, slot, value, session.lease_id, guard)
        )
        revision = int(put.header.revision)
        if put.succeeded:
            horizon = touched + QUEUE_HORIZON * ttl
            at = queue_slot(slot)
            entry = Entry(name, owner, revision, session, horizon, queued=True, slot=at)
            self._sessions.attach(entry)
        return put.responses[-1].response_range.kvs, revision

    async def _regrant_permit(
        self, name: str, owner: str, ttl: float, key: PermitKey, session: Session, touched: float
    ) -> Grant | None:
        """``owner`` holds ``key``: its grant again, its key on ``session``."""
        self._forget_queued(name, owner)
        if key.lease != session.lease_id:
            moved = await self._wire.txn(
                self._layout.move(name, key.slot, key.token, session.lease_id)
            )
            if not moved.succeeded:
                return None
        entry = self._sessions.entries.get((name, owner))
        if entry is None or entry.token != key.token:
            entry = Entry(
                name, owner, key.token, session, touched + ttl, slot=key.slot, weight=key.weight
            )
            self._sessions.attach(entry)
        elif entry.session is not session:
            self._sessions.move(entry, session)
        return self._granted(entry, ttl, touched)

    async def _grant_queued(
        self,
        name: str,
        owner: str,
        ttl: float,
        queued: tuple[str, int, int],
        value: bytes,
        session: Session,
        touched: float,
    ) -> Grant | None:
        """``owner``'s queue key (``queued``: the slot of its permit key, its token and
        weight) fits: replace it by a permit key (a new token); ``None`` if it is gone."""
        slot, token, weight = queued
        request = self._layout.permit_grant(name, slot, token, value, session.lease_id)
        reply = await self._wire.txn(request)
        if not reply.succeeded:
            return None
        self._forget_queued(name, owner)
        old = self._sessions.entries.get((name, owner))
        if old is not None:
            self._sessions.end(old, LossReason.RELEASED)  # its queue key is deleted
        token = int(reply.header.revision)
        entry = Entry(name, owner, token, session, touched + ttl, slot=slot, weight=weight)
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

    def _note_turn(self, name: str, owner: str, turn: Turn, queued: bool = True) -> None:
        """Keep ``turn`` for the refused request's wait (``queued``: its queue key is
        live; the wait makes it a candidate for a hand-off, see :meth:`_hand_permit`)."""
        if len(self._permit_seen) >= SEEN_LIMIT:
            del self._permit_seen[next(iter(self._permit_seen))]
        self._permit_seen[(name, owner)] = turn
        turn.queued = queued
        self._forget_queued(name, owner)  # until it waits again

    def _forget_queued(self, name: str, owner: str) -> None:
        """``owner``'s request on ``name`` is no longer queued here."""
        queued = self._permit_queued.get(name)
        if queued is not None and queued.pop(owner, None) is not None and not queued:
            del self._permit_queued[name]

    async def wait_permit_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Watch the name's permit keys from the refused request's read until the weight
        that blocks it is gone (permits released or lost, queue keys ahead of it gone
        without a grant), or its own queue key is; at most a third of ``ttl``. Only
        the waiters whose turn may have come wake, not every waiter at every release.
        A release through this backend may hand the waiter its grant instead
        (:meth:`_hand_permit`): it wakes at once, and its next attempt takes it."""
        self._check_open()
        turn = self._permit_seen.pop((name, owner), None)
        if turn is None:
            return
        entry = self._sessions.entries.get((name, owner))
        if entry is not None and entry.queued:
            entry.horizon = max(entry.horizon, now() + QUEUE_HORIZON * ttl)
        if turn.deficit <= 0:
            return
        if turn.queued:  # a candidate for a hand-off from now on, until granted
            if len(self._permit_queued) >= SEEN_LIMIT and name not in self._permit_queued:
                del self._permit_queued[next(iter(self._permit_queued))]
            self._permit_queued.setdefault(name, {})[owner] = turn
        turn.woken = asyncio.get_running_loop().create_future()
        # On the backend's one stream for permit waits, with the other waiters of the name
        # (see :mod:`._permit_watch`): no stream, and most often no message, of its own.
        waiter = self._permit_watches.wait(name, turn.revision, turn.accept)
        try:
            done, _ = await asyncio.wait(
                (waiter.done, turn.woken), timeout=ttl / 3, return_when=asyncio.FIRST_COMPLETED
            )
            while turn.handing and not turn.woken.done():
                # The watch saw the hand-off (its queue key deleted) before its sender here
                # got the reply: wait for the hand-offs that may have granted it, and take
                # the grant without a request.
                await asyncio.wait(tuple(turn.handing))
        finally:
            self._permit_watches.leave(waiter)
            turn.woken.cancel()  # (no-op if a hand-off woke it)
            turn.asking = turn.woken.cancelled()  # it asks again: no hand-off to it now
        if waiter.done in done:
            waiter.done.result()  # what the watch raised
            if turn.ready and turn.asking:
                if len(self._permit_ready) >= SEEN_LIMIT:
                    del self._permit_ready[next(iter(self._permit_ready))]
                self._permit_ready[(name, owner)] = turn

    async def _hand_permit(self, entry: Entry) -> bool:
        """Release the held permit ``entry`` by handing its place to the oldest request
        queued here that waits for its turn, in one transaction; whether it was done
        (else nothing changed: the caller deletes the key).

        Only when that request is the first in the name's queue and asks for no more
        weight than ``entry`` frees: the weight held then never grows, so it stays within
        the limit, and nobody is passed. But requests queued here that found, from their
        watch, that they fit (and now ask for their grant) are passed: they still fit
        afterwards, since the weight held did not grow, so the grant obeys the rule
        (``held + queued_ahead + weight <= limit``), and waiting for them would make the
        next waiter's turn come by its watch instead of by this hand-off, and so on.

        Releases of the name here go in parallel, and etcd may apply their transactions
        in any order: so each is a cascade (:meth:`Layout.permit_handoff`, nested), to
        the first waiting request if it is still queued, else to the second if the first
        is gone, and so on (up to :data:`HANDOFF_BRANCHES`): whichever applies first
        grants the first request, the next the second, and none fails for having been
        applied before another (one in two did, and was sent again once the other was
        over). Grants stay in queue order, each in a revision of its own: its token, newer
        than every earlier grant's. The waiter's next attempt takes the grant without a
        request; should it give up instead, its release deletes whichever of its two keys
        exists (:meth:`Layout.permit_give_up`)."""
        queued_here = self._permit_queued.get(entry.name)
        if not queued_here or entry.weight < 1:
            return False
        name, layout, touched = entry.name, self._layout, now()
        line = sorted(queued_here.values(), key=lambda waiting: waiting.mine)
        keys = [layout.queue_key(name, turn.slot) for turn in line]
        # Enough branches for the hand-offs of the name under way here, and one more.
        under_way = len({sent for turn in line for sent in turn.handing})
        branches = min(HANDOFF_BRANCHES, under_way + 2)
        passing: list[bytes] = []  # the keys of those that ask for a grant they found fit
        targets: list[tuple[Turn, Entry]] = []
        earlier: list[bytes] = []  # the keys of the targets so far
        requests: list[bytes] = []  # each branch serialized
        compares = 0
        for index, turn in enumerate(line):
            if turn.asking:
                if not turn.ready:
                    break  # asking again, maybe not fitting: not to be passed
                passing.append(keys[index])
                continue
            queued = self._sessions.entries.get((name, turn.owner))
            if (
                turn.weight > entry.weight
                or queued is None
                or not queued.queued
                or queued.token != turn.mine
                or queued.reason is not None
                or not queued.session.usable(touched)
            ):
                break
            # Handed to ``turn`` if the requests before it are gone (granted by another
            # release, or given up: ``earlier``, compared one by one) or passed.
            # (None passed: the default, every queue key, its own among them.)
            behind = keys[index:]
            ranges = [
                (low, high, any(low <= key < high for key in behind))
                for low, high in (layout.queue_ranges(name, passing) if passing else ())
            ]
            request = layout.permit_handoff(
                name,
                (entry.slot, entry.token),
                turn.slot,
                turn.mine,
                turn.value,
                queued.session.lease_id,
                ranges,
                earlier,
            )
            compares += 3 + max(len(ranges), 1) + len(earlier)
            if compares > HANDOFF_COMPARES:
                break
            targets.append((turn, queued))
            requests.append(request)
            earlier = [*earlier, keys[index]]
            if len(targets) >= branches:
                break
        if not targets:
            return False
        sending: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for turn, _ in targets:
            turn.handing.append(sending)
        try:
            reply = await self._wire.txn(encoded.cascade(requests))
        finally:
            for turn, _ in targets:
                turn.handing.remove(sending)
            sending.set_result(None)
        level, branch = reply, 0
        while not level.succeeded:
            branch += 1
            if branch >= len(targets):
                return False
            level = level.responses[0].response_txn
        turn, queued = targets[branch]
        if queued_here.get(turn.owner) is turn:
            self._forget_queued(name, turn.owner)
        if self._sessions.entries.get((name, turn.owner)) is queued:
            token = int(reply.header.revision)
            self._sessions.end(queued, LossReason.RELEASED)  # its queue key is deleted
            session, expiry = queued.session, touched + turn.ttl
            granted = Entry(
                name, turn.owner, token, session, expiry, slot=turn.slot, weight=turn.weight
            )
            self._sessions.attach(granted)
            if len(self._permit_handed) >= SEEN_LIMIT:
                del self._permit_handed[next(iter(self._permit_handed))]
            self._permit_handed[(name, turn.owner)] = token
        # (Else the request's own attempt moved or replaced its entry meanwhile: that
        # attempt, or the next, finds its permit key on the server; a release deletes it.)
        if turn.woken is not None and not turn.woken.done():
            turn.woken.set_result(None)
        return True


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
