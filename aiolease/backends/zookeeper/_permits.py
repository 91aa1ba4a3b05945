"""Permits (semaphores and read-write locks) on ZooKeeper: the permit contract of
``docs/internals/semaphores.md`` over the nodes of :mod:`._permit_nodes`.

A request creates its node and lists the name's permit nodes in one round trip; its
place in the listing decides (rule 3, FIFO across readers and writers). A granted
request's token is the zxid of the write that told its node so: its create (granted
at once) or the ``SetData`` that flips a queued node to held, so that tokens follow
the order of grants (rule 6). A refused request keeps its node (its place in the
queue) and flips it to queued. A node rides on the backend's session like a lock's:
renewals, ``hold`` and loss are the lock's (:class:`._session.Keeper`).

Waiting (:meth:`Permits.wait_turn`): the first waiter in line (every node before its
own is granted) watches each of those nodes (past :data:`WATCH_AHEAD` of them, the
name's children); any later waiter watches only the node just before its own, whose
grant (a ``SetData``) or delete is what may let it in next. Arrivals behind a waiter
wake nobody.

Waiters of the same backend object need no watch to learn of their turn: every
listing of a name's nodes that this backend reads wakes each of its own waiters whose
node the listing shows granted, and hands it that listing, so that its retry is one
write (the ``SetData`` that marks it held), not a listing and then the write. (A
node that fits fits until it goes: a listing that shows it granted stays true.)
Without this, a waiter learnt of its turn only once the one before it was granted,
one after the other, and a semaphore served no faster than a lock.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from typing import Any

from aiozk import protocol

from ..._exceptions import BackendUnavailable, ForeignDataError, LimitMismatchError, LossReason
from ..._permits import PermitHolders
from ...abc import Grant, HolderInfo
from .._asyncio import now, wait_any
from ._permit_nodes import (
    PermitLayout,
    PermitNode,
    decode_permit,
    encode_permit,
    fitting,
    foreign_permit,
    standing,
)
from ._session import Entry, Keeper
from ._wire import Wire

__all__ = ["Permits"]

#: A queued request is dropped after this many ttls without a retry.
QUEUE_HORIZON = 2.0
#: Attempts at deciding while the queue moves under the reads. Contention alone never
#: spends them (a request holds its place in the queue: it is not raced for, as etcd's
#: were until they queued): an attempt is retried only when the request's own node is
#: gone (then a new one is made), or when every node before it went while they were
#: read (then nodes only join behind it, and the next attempt is granted).
ATTEMPTS = 20
#: How many queued requests' turns are remembered.
TURNS_LIMIT = 4096
#: The first waiter in line watches each node before its own, up to this many (else
#: the name's children, which arrivals behind it change too).
WATCH_AHEAD = 16
#: Nodes before a refused request read at once to find the first still there.
READ_AHEAD = 4


class Permits:
    """The permit operations of one :class:`~._backend.ZooKeeperBackend`.

    :param wire: its session
    :param keeper: its entries (permits are entries like locks)
    :param base: ``<chroot>/<prefix>``
    :param grant: makes the :class:`Grant` of a granted entry for a ttl
    """

    def __init__(
        self, wire: Wire, keeper: Keeper, base: str, grant: Callable[[Entry, float], Grant]
    ) -> None:
        self.wire = wire
        self.keeper = keeper
        self.layout = PermitLayout(base)
        self.grant = grant
        #: Requests whose create may have been applied without its reply seen.
        self.unsure: set[tuple[str, str]] = set()
        #: Queued requests: the node before theirs, whether it was granted (theirs is
        #: first in line), and then the nodes before theirs (up to WATCH_AHEAD).
        self.turns: dict[tuple[str, str], tuple[str, bool, tuple[str, ...]]] = {}
        #: Requests waiting for their turn here (``wait_turn``), by name and owner: what
        #: wakes them when a listing shows them granted (:meth:`_saw`).
        self.waiting: dict[str, dict[str, asyncio.Future[None]]] = {}
        #: A listing that showed a waiting request granted, for its retry.
        self.fits: dict[tuple[str, str], list[PermitNode]] = {}
        #: Names whose last listing had requests waiting: a new request there is
        #: created queued (it will wait), not held (then marked queued: a write more).
        self.crowded: dict[str, None] = {}

    # -- acquire -------------------------------------------------------------------------

    async def try_acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        touched = now()
        key = (name, owner)
        for _ in range(ATTEMPTS):
            entry = self.keeper.entries.get(key)
            if entry is None and key in self.unsure:
                entry = await self._find(name, owner, touched + ttl)
            fresh = entry is None
            # Whether its node's data says held (what a refusal must correct).
            says_held = fresh and name not in self.crowded
            if entry is None:
                data = encode_permit(identity, metadata, says_held)
                entry, queue = await self._enqueue(name, owner, limit, weight, data, touched + ttl)
            else:
                # A listing that showed it granted stays true while its node lives.
                known = self.fits.pop(key, None)
                queue = await self._queue(name) if known is None else known
            paths = [self.layout.path(name, n.node) for n in queue]
            if entry.reason is not None or entry.path not in paths:
                self.keeper.end(entry, LossReason.EXPIRED)  # gone: ask anew
                continue
            index = paths.index(entry.path)
            place = standing(queue, index + 1, limit)  # its own node included
            if place.other_limit is not None:
                if fresh:  # nothing changes: its node goes
                    await self._drop(entry)
                raise LimitMismatchError(name, limit, place.other_limit)
            if entry.session_id != self.wire.session_id:
                # Its node rode on a session the server has expired since.
                self.keeper.end(entry, LossReason.STOLEN)
                continue
            if not entry.queued:  # a retry by the holder
                return self._renewed(entry, touched, ttl)
            if queue[index].weight != weight:
                # Another weight: a new request (a node's weight is in its name).
                await self._drop(entry)
                continue
            if place.ahead <= limit:
                if await self._granted(entry, says_held, identity, metadata):
                    return self._renewed(entry, touched, ttl)
                continue
            entry.horizon = max(entry.horizon, touched + QUEUE_HORIZON * ttl)
            self.keeper.poke(entry.horizon)
            first = fitting(queue) >= index
            ahead = tuple(paths[:index]) if first and index <= WATCH_AHEAD else ()
            self._note_turn(key, paths[index - 1], first, ahead)
            flip = None
            if says_held or not entry.data:  # created as held (or found, unread): tell the truth
                entry.data = encode_permit(identity, metadata, False)
                flip = self.wire.set_data(self.wire.path(entry.path), entry.data)
            blocker = await self._blocker(name, queue[:index], flip)
            if blocker is not None:
                return blocker
        raise BackendUnavailable(f"ZooKeeper: the permits of {name!r} moved under every attempt")

    def _note_turn(
        self, key: tuple[str, str], before: str, first: bool, ahead: tuple[str, ...]
    ) -> None:
        """Remember what a queued request waits for (the oldest forgotten past
        :data:`TURNS_LIMIT`: its wait then returns at once, and its retry notes it again)."""
        self.turns.pop(key, None)
        if len(self.turns) >= TURNS_LIMIT:
            del self.turns[next(iter(self.turns))]
        self.turns[key] = (before, first, ahead)

    def _renewed(self, entry: Entry, touched: float, ttl: float) -> Grant:
        entry.queued = False
        self.turns.pop((entry.name, entry.owner), None)
        if entry.horizon != math.inf:
            entry.horizon = touched + ttl
            self.keeper.poke(entry.horizon)
        return self.grant(entry, ttl)

    async def _granted(
        self, entry: Entry, created_held: bool, identity: str, metadata: Mapping[str, str]
    ) -> bool:
        """``entry``'s node fits: one just created held is granted (its token its
        create); a queued one is flipped to held, its token the zxid of that write.
        ``False``: its node went meanwhile."""
        if created_held:
            return True
        data = encode_permit(identity, metadata, True)
        (written,) = await self.wire.send(self.wire.set_data(self.wire.path(entry.path), data))
        if isinstance(written, Exception):
            self.keeper.end(entry, LossReason.EXPIRED)
            return False
        if entry.reason is not None:
            return False
        entry.token = int(written.stat.last_modified_zxid)
        entry.data = data
        return True

    def forget(self, name: str, owner: str) -> None:
        """``owner``'s request of ``name`` is over: what was noted of its turn goes."""
        self.turns.pop((name, owner), None)
        self.fits.pop((name, owner), None)

    async def _drop(self, entry: Entry) -> None:
        """Delete ``entry``'s node (a request given up)."""
        self.keeper.end(entry, LossReason.RELEASED, quietly=True)
        self.forget(entry.name, entry.owner)
        try:
            await self.wire.send(self.wire.delete(self.wire.path(entry.path)))
        except BaseException:
            self.keeper.zombies[entry.path] = entry.session_id
            raise

    async def _enqueue(
        self, name: str, owner: str, limit: int, weight: int, data: bytes, horizon: float
    ) -> tuple[Entry, list[PermitNode]]:
        """Create ``owner``'s node and list the name's (one round trip)."""
        path = self.wire.path(self.layout.new_node(name, owner, limit, weight))
        parent = self.wire.path(self.layout.permits_node(name))
        self.unsure.add((name, owner))
        created, listed = await self.wire.create_and_list(path, parent, data)
        node = created.path.rsplit("/", 1)[1]
        entry = Entry.created(
            name, owner, created, self.layout.path(name, node), self.wire.session_id, horizon, data
        )
        self.keeper.attach(entry)
        self.unsure.discard((name, owner))
        try:
            if isinstance(listed, Exception):
                return entry, await self._queue(name)
            return entry, self._saw(name, self.layout.queue(name, listed.children))
        except ForeignDataError:
            await self._drop(entry)  # nothing is granted over a foreign node
            raise

    async def _queue(self, name: str, watch: bool = False) -> list[PermitNode]:
        """The permit nodes of ``name`` in arrival order (empty if it has none)."""
        parent = self.wire.path(self.layout.permits_node(name))
        (listed,) = await self.wire.send(self.wire.children(parent, watch))
        if isinstance(listed, Exception):
            return []
        return self._saw(name, self.layout.queue(name, listed.children))

    def _saw(self, name: str, queue: list[PermitNode]) -> list[PermitNode]:
        """Wake the requests waiting here whose nodes ``queue`` (a listing just read)
        shows granted, handing them the listing, and note whether any waits; ``queue``."""
        granted = fitting(queue)
        if granted < len(queue):
            if name not in self.crowded and len(self.crowded) >= TURNS_LIMIT:
                del self.crowded[next(iter(self.crowded))]
            self.crowded[name] = None
        else:
            self.crowded.pop(name, None)
        waiting = self.waiting.get(name)
        if waiting:
            for node in queue[:granted]:
                wake = waiting.get(node.owner)
                if wake is not None and not wake.done():
                    if len(self.fits) >= TURNS_LIMIT:
                        del self.fits[next(iter(self.fits))]
                    self.fits[(name, node.owner)] = queue
                    wake.set_result(None)
        return queue

    async def _find(self, name: str, owner: str, horizon: float) -> Entry | None:
        """``owner``'s node from a create whose reply was lost, if it exists and rides on
        this backend's session; taken as queued (a grant flips it, a new token)."""
        found = None
        for node in [n for n in await self._queue(name) if n.owner == owner]:
            path = self.layout.path(name, node.node)
            (stat,) = await self.wire.send(self.wire.exists(self.wire.path(path)))
            if isinstance(stat, Exception):
                continue
            if stat.stat.ephemeral_owner != self.wire.session_id or found is not None:
                continue  # another session's: never taken for ours
            token = int(stat.stat.created_zxid)
            found = Entry(name, owner, token, node.sequence, path, self.wire.session_id, horizon)
            self.keeper.attach(found)
        self.unsure.discard((name, owner))
        return found

    async def _read(
        self, name: str, nodes: list[PermitNode], *extra: Any
    ) -> list[tuple[PermitNode, str, dict[str, str], bool, int] | None]:
        """Each node's identity, metadata, held flag and token (``None``: gone), read in
        one round trip (with ``extra`` requests after them)."""
        gets = [self.wire.get(self.wire.path(self.layout.path(name, n.node))) for n in nodes]
        replies = await self.wire.send(*gets, *extra)
        found: list[tuple[PermitNode, str, dict[str, str], bool, int] | None] = []
        for node, reply in zip(nodes, replies, strict=False):
            if isinstance(reply, Exception):
                found.append(None)
                continue
            try:
                identity, metadata, held = decode_permit(reply.data)
            except (ValueError, UnicodeDecodeError) as exc:
                raise foreign_permit(
                    name, node.node, f"its data is not aiolease's ({exc})"
                ) from None
            token = int(reply.stat.last_modified_zxid)
            found.append((node, identity, metadata, held, token))
        return found

    async def _blocker(self, name: str, ahead: list[PermitNode], flip: Any) -> HolderInfo | None:
        """Who blocks a request: the oldest node before it still there (token 0 if it is
        queued); ``None`` if every one of them went meanwhile. A node of this backend's
        is answered from its entry (no read, as a lock's holder); the others are read
        :data:`READ_AHEAD` at a time (those first in line are the likeliest to have
        gone since the listing). ``flip``: a request sent along in the first round trip."""
        extra = () if flip is None else (flip,)
        start = 0
        while start < len(ahead):
            batch = []
            for node in ahead[start : start + READ_AHEAD]:
                if self._mine(name, node) is not None:
                    break
                batch.append(node)
            if not batch:  # a live node of ours: what it holds is known here
                node = ahead[start]
                mine = self._mine(name, node)
                assert mine is not None
                identity, metadata, held = decode_permit(mine.data)
                holder = HolderInfo(
                    name, node.owner, identity, mine.token if held else 0, metadata, None
                )
                if extra:
                    await self.wire.send(*extra)
                return holder
            reads = await self._read(name, batch, *extra)
            extra = ()
            for read in reads:
                if read is not None:
                    node, identity, metadata, held, token = read
                    return HolderInfo(
                        name, node.owner, identity, token if held else 0, metadata, None
                    )
            start += len(batch)
        if extra:
            await self.wire.send(*extra)
        return None

    def _mine(self, name: str, node: PermitNode) -> Entry | None:
        """The live entry of this backend whose node ``node`` is, if its data is known."""
        mine = self.keeper.entries.get((name, node.owner))
        if mine is None or not mine.data or mine.path != self.layout.path(name, node.node):
            return None
        return mine

    # -- read and wait ---------------------------------------------------------------------

    async def read(self, name: str) -> PermitHolders | None:
        for _ in range(ATTEMPTS):
            queue = await self._queue(name)
            if not queue:
                return None
            reads = [r for r in await self._read(name, queue) if r is not None]
            if not reads:
                continue
            nodes = [r[0] for r in reads]
            granted = fitting(nodes)
            holders, weights = [], []
            for node, identity, metadata, held, token in reads[:granted]:
                if held:
                    holders.append(HolderInfo(name, node.owner, identity, token, metadata, None))
                    weights.append(node.weight)
            waiting = len(reads) - len(holders)
            return PermitHolders(name, nodes[0].limit, tuple(holders), tuple(weights), waiting)
        raise BackendUnavailable(f"ZooKeeper: the permits of {name!r} moved under every read")

    async def wait_turn(self, name: str, owner: str, ttl: float, closed: asyncio.Event) -> None:
        """Return when ``owner``'s queued request may be granted on a retry (or after a
        bound well within ``ttl``)."""
        entry = self.keeper.entries.get((name, owner))
        turn = self.turns.get((name, owner))
        if entry is None or not entry.queued or turn is None or (name, owner) in self.fits:
            return
        entry.horizon = max(entry.horizon, now() + QUEUE_HORIZON * ttl)
        self.keeper.poke(entry.horizon)
        wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self.waiting.setdefault(name, {})
        waiting[owner] = wake
        try:
            await self._wait_turn(entry, name, turn, wake, closed, ttl / 2)
        finally:
            if waiting.get(owner) is wake:
                del waiting[owner]
            if not waiting and self.waiting.get(name) is waiting:
                del self.waiting[name]

    async def _wait_turn(
        self,
        entry: Entry,
        name: str,
        turn: tuple[str, bool, tuple[str, ...]],
        wake: asyncio.Future[None],
        closed: asyncio.Event,
        bound: float,
    ) -> None:
        """:meth:`wait_turn`'s watches; ``wake`` is set by a listing of this backend
        that shows the request granted."""
        before, first, ahead = turn
        parent = self.wire.path(self.layout.permits_node(name))
        if ahead:  # first in line: any permit that goes may let it in
            await self._wait_ahead(entry, name, ahead, wake, closed, bound)
            return
        if first:  # too many before it to watch each: watch the children
            changed, stop = self.wire.watch(protocol.WatchEvent.CHILDREN_CHANGED, parent)
            try:
                (listed,) = await self.wire.send(self.wire.children(parent, watch=True))
                if isinstance(listed, Exception) or self._may_fit(entry, name, listed.children):
                    return
                await wait_any([changed, wake], closed, bound)
            finally:
                stop()
            return
        # Only the node before it matters now: its grant (a SetData) or its delete.
        full = self.wire.path(before)
        gone, stop_gone = self.wire.watch(protocol.WatchEvent.DELETED, full)
        flipped, stop_flipped = self.wire.watch(protocol.WatchEvent.DATA_CHANGED, full)
        try:
            stat, listed = await self.wire.send(
                self.wire.exists(full, watch=True), self.wire.children(parent)
            )
            if isinstance(stat, Exception) or isinstance(listed, Exception):
                return
            queue = self._saw(name, self.layout.queue(name, listed.children))
            paths = [self.layout.path(name, n.node) for n in queue]
            if entry.path not in paths or before not in paths:
                return
            if fitting(queue) >= paths.index(before) + 1:
                return  # the node before it is granted: it is first in line now
            await wait_any([gone, flipped, wake], closed, bound)
        finally:
            stop_gone()
            stop_flipped()

    async def _wait_ahead(
        self,
        entry: Entry,
        name: str,
        ahead: tuple[str, ...],
        wake: asyncio.Future[None],
        closed: asyncio.Event,
        bound: float,
    ) -> None:
        """Watch each node before ``entry``'s (all granted): return when one goes, or
        changes (a granted one marked held: its watch is spent, so look again)."""
        fulls = [self.wire.path(path) for path in ahead]
        watches = [
            self.wire.watch(kind, full)
            for full in fulls
            for kind in (protocol.WatchEvent.DELETED, protocol.WatchEvent.DATA_CHANGED)
        ]
        try:
            parent = self.wire.path(self.layout.permits_node(name))
            *stats, listed = await self.wire.send(
                *(self.wire.exists(full, watch=True) for full in fulls),
                self.wire.children(parent),
            )
            if any(isinstance(stat, Exception) for stat in stats):
                return  # one went already
            if isinstance(listed, Exception) or self._may_fit(entry, name, listed.children):
                return
            await wait_any([*(fired for fired, _ in watches), wake], closed, bound)
        finally:
            for _, stop in watches:
                stop()

    def _may_fit(self, entry: Entry, name: str, children: list[str]) -> bool:
        queue = self._saw(name, self.layout.queue(name, children))
        paths = [self.layout.path(name, n.node) for n in queue]
        return entry.path not in paths or fitting(queue) > paths.index(entry.path)

    # -- release of a node this backend does not track -------------------------------------

    async def release_unknown(self, name: str, owner: str, token: int | None) -> bool:
        """Delete ``owner``'s nodes of ``name`` (a create whose reply was lost, or a node
        of another backend object); whether a granted permit (of ``token``) was freed."""
        queue = await self._queue(name)
        granted = fitting(queue)
        freed = False
        for index, node in enumerate(queue):
            if node.owner != owner:
                continue
            path = self.layout.path(name, node.node)
            (read,) = await self._read(name, [node])
            if read is None or (token is not None and read[4] != token):
                continue
            zombie = self.keeper.zombies.pop(path, None)
            (deleted,) = await self.wire.send(self.wire.delete(self.wire.path(path)))
            freed = freed or (
                read[3]
                and index < granted
                and zombie is None
                and not isinstance(deleted, Exception)
            )
        self.unsure.discard((name, owner))
        return freed
