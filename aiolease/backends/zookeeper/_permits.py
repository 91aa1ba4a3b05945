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

A release here grants the next request waiting here in its own write, and a waiter
behind nodes of this backend only sets no watch (:mod:`._permit_hand_off`).
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiozk import protocol

from ..._exceptions import BackendUnavailable, ForeignDataError, LimitMismatchError, LossReason
from ..._permits import PermitHolders
from ...abc import Grant, HolderInfo
from .._asyncio import now, wait_any
from ._permit_hand_off import passed, release_now, reserve, settle
from ._permit_mirror import Mirrors
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
#: How many nodes of ended entries are remembered (they are gone long before).
DEAD_LIMIT = 4096


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
        #: The last listing of each name's nodes read here (arrival order).
        self.views: dict[str, list[PermitNode]] = {}
        #: Nodes (by child name) of this backend's ended entries: whoever owned them
        #: holds nothing through them, and never will, deleted yet or not.
        self.dead: dict[str, None] = {}
        #: Queued requests whose grant is being written (a release's ``Multi``, or their
        #: own ``SetData``): set once it is decided.
        self.busy: dict[tuple[str, str], asyncio.Future[None]] = {}
        #: Queued requests refused here: the data that marks each node held.
        self.asks: dict[tuple[str, str], bytes] = {}
        #: Requests granted by a release of this backend, for their next try.
        self.handed: set[tuple[str, str]] = set()
        #: Queued requests whose token is their create's zxid, by name, owner -> the
        #: node's sequence (see :meth:`_reserve`): a release here grants one of them
        #: as it is written, without waiting for the server's answer.
        self.reserved: dict[str, dict[str, int]] = {}
        #: Grants made that way (``statistics().permit_hand_offs``).
        self.hand_offs = 0
        #: The names' nodes as this backend's own requests left them (:mod:`._permit_mirror`).
        self.mirrors = Mirrors(self.layout)

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
            busy = self.busy.get(key)
            if busy is not None:  # a release is granting it: wait for the answer
                await asyncio.wait([busy])
                continue
            entry = self.keeper.entries.get(key)
            if entry is not None and key in self.handed:
                self.handed.discard(key)
                if self._handed(entry, limit):
                    self.hand_offs += 1
                    return self._renewed(entry, touched, ttl)
            if entry is None and key in self.unsure:
                entry = await self._find(name, owner, touched + ttl)
            fresh = entry is None
            # Whether its node's data says held (what a refusal must correct).
            says_held = fresh and name not in self.crowded
            if entry is None:
                data = encode_permit(identity, metadata, says_held)
                entry, listed = await self._enqueue(name, owner, limit, weight, data, touched + ttl)
            else:
                # A listing that showed it granted stays true while its node lives.
                known = self.fits.pop(key, None)
                listed = await self._queue(name) if known is None else known
            # Nodes of this backend's ended entries hold nothing: they do not count.
            queue = self.live(listed)
            index = _place(queue, entry)
            if entry.reason is not None or index is None:
                self.keeper.end(entry, LossReason.EXPIRED)  # gone: ask anew
                continue
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
                # Its create is its grant only if it fits counting every node listed
                # (else it fits as the nodes of ended entries go: a SetData grants it).
                created_held = says_held and (
                    queue is listed or fitting(listed) > listed.index(queue[index])
                )
                if await self._granted(entry, created_held, identity, metadata):
                    return self._renewed(entry, touched, ttl)
                continue
            entry.horizon = max(entry.horizon, touched + QUEUE_HORIZON * ttl)
            self.keeper.poke(entry.horizon)
            self._note_ask(key, encode_permit(identity, metadata, True))
            if fresh:
                reserve(self, entry, queue[:index])
            first = fitting(queue) >= index
            path = self.layout.path
            watched = first and index <= WATCH_AHEAD
            ahead = tuple(path(name, n.node) for n in queue[:index]) if watched else ()
            before = path(name, queue[index - 1].node)  # (a refused node has one)
            self._note_turn(key, before, first, ahead)
            flip = None
            if says_held or not entry.data:  # created as held (or found, unread): tell the truth
                entry.data = encode_permit(identity, metadata, False)
                flip = self.wire.set_data(self.wire.path(entry.path), entry.data)
            blocker = await self._blocker(name, queue[:index], flip)
            if blocker is not None:
                return blocker
        raise BackendUnavailable(f"ZooKeeper: the permits of {name!r} moved under every attempt")

    def _handed(self, entry: Entry, limit: int) -> bool:
        """Whether ``entry``, granted by a release of this backend, is granted to a retry
        asking with ``limit`` (else the retry goes the long way: a limit other than its
        node's raises there)."""
        node = self.layout.parse(entry.name, entry.path.rsplit("/", 1)[1])
        return (
            entry.reason is None
            and not entry.queued
            and entry.session_id == self.wire.session_id
            and node.limit == limit
        )

    def _note_ask(self, key: tuple[str, str], held: bytes) -> None:
        """Remember the data that marks queued request ``key``'s node held."""
        if key not in self.asks and len(self.asks) >= TURNS_LIMIT:
            del self.asks[next(iter(self.asks))]
        self.asks[key] = held

    def _note_turn(
        self, key: tuple[str, str], before: str, first: bool, ahead: tuple[str, ...]
    ) -> None:
        """Remember what a queued request waits for (the oldest forgotten past
        :data:`TURNS_LIMIT`: its wait then returns at once, and its retry notes it again)."""
        self.turns.pop(key, None)
        if len(self.turns) >= TURNS_LIMIT:
            del self.turns[next(iter(self.turns))]
        self.turns[key] = (before, first, ahead)

    def revoke(self, name: str) -> None:
        """Revoke every reservation of ``name`` (before a grant with a new token)."""
        self.reserved.pop(name, None)

    def _renewed(self, entry: Entry, touched: float, ttl: float) -> Grant:
        entry.queued = False
        self.forget(entry.name, entry.owner)
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
        # Granted now with a token of its own: no reserved request may be granted
        # later with the (smaller) zxid of its create.
        self.revoke(entry.name)
        if created_held:
            return True
        data = encode_permit(identity, metadata, True)
        key = (entry.name, entry.owner)
        if key in self.busy:  # a release is granting it meanwhile: its answer decides
            return False
        busy = self.busy[key] = asyncio.get_running_loop().create_future()
        try:
            (written,) = await self.wire.send(self.wire.set_data(self.wire.path(entry.path), data))
        finally:
            if self.busy.get(key) is busy:
                del self.busy[key]
            busy.set_result(None)
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
        self.asks.pop((name, owner), None)
        self.handed.discard((name, owner))
        reserved = self.reserved.get(name)
        if reserved is not None and reserved.pop(owner, None) is not None and not reserved:
            del self.reserved[name]

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
        seen: list[list[PermitNode]] = []
        created, listed = await self.wire.create_and_list(
            path,
            parent,
            data,
            functools.partial(self.mirrors.created, name, seen),
            functools.partial(self.mirrors.listed, name),
            listing=not self._trusted(name),
        )
        node = created.path.rsplit("/", 1)[1]
        entry = Entry.created(
            name, owner, created, self.layout.path(name, node), self.wire.session_id, horizon, data
        )
        self.layout.known(PermitNode(entry.sequence, node, owner, limit, weight))
        self.keeper.attach(entry)
        self.unsure.discard((name, owner))
        try:
            if listed is None and seen:  # the name's mirror, as the create left it
                return entry, self._saw(name, seen[0])
            if listed is None or isinstance(listed, Exception):
                return entry, await self._queue(name)
            return entry, self._saw(name, self.layout.queue(name, listed.children))
        except ForeignDataError:
            await self._drop(entry)  # nothing is granted over a foreign node
            raise

    async def _queue(self, name: str, watch: bool = False) -> list[PermitNode]:
        """The permit nodes of ``name`` in arrival order (empty if it has none)."""
        parent = self.wire.path(self.layout.permits_node(name))
        children = self.wire.children(parent, watch)
        children.then = functools.partial(self.mirrors.listed, name)
        (listed,) = await self.wire.send(children)
        if isinstance(listed, Exception):
            return []
        return self._saw(name, self.layout.queue(name, listed.children))

    def _saw(self, name: str, listed: list[PermitNode]) -> list[PermitNode]:
        """Note ``listed`` (a listing of ``name``'s nodes just read) as the name's view,
        whether any request waits there, and wake the requests waiting here that it
        shows granted; ``listed``."""
        if name not in self.views and len(self.views) >= TURNS_LIMIT:
            del self.views[next(iter(self.views))]
        self.views[name] = listed
        queue = self.live(listed)
        passed(self, name, queue)
        granted = fitting(queue)
        if granted < len(queue):
            if name not in self.crowded and len(self.crowded) >= TURNS_LIMIT:
                del self.crowded[next(iter(self.crowded))]
            self.crowded[name] = None
        else:
            self.crowded.pop(name, None)
        self._wake(name, queue, granted)
        return listed

    def _trusted(self, name: str) -> bool:
        """Whether a create under ``name`` may go without a listing: the name has a
        mirror, and it lists a live node of ours on the current session (so the
        permits node is the one mirrored: a container is not reaped while it has a
        child)."""
        mirror = self.mirrors.trusted(name)
        if mirror is None:
            return False
        sid = self.wire.session_id
        for node in mirror.nodes:
            mine = self.keeper.entries.get((name, node.owner))
            if (
                mine is not None
                and mine.reason is None
                and mine.session_id == sid
                and mine.path.endswith(node.node)
                and node.node not in self.dead
            ):
                return True
        return False

    def live(self, listed: list[PermitNode]) -> list[PermitNode]:
        """``listed`` without the nodes of this backend's ended entries (``listed``
        itself when it has none)."""
        dead = self.dead
        if not dead or not any(n.node in dead for n in listed):
            return listed
        return [n for n in listed if n.node not in dead]

    def _wake(self, name: str, queue: list[PermitNode], granted: int) -> None:
        """Wake the requests waiting here among the first ``granted`` nodes of ``queue``
        (those it shows granted), handing them ``queue`` for their retry."""
        waiting = self.waiting.get(name)
        if not waiting:
            return
        for node in queue[:granted]:
            wake = waiting.get(node.owner)
            if wake is not None and not wake.done() and (name, node.owner) not in self.busy:
                if len(self.fits) >= TURNS_LIMIT:
                    del self.fits[next(iter(self.fits))]
                self.fits[(name, node.owner)] = queue
                wake.set_result(None)

    def ended(self, entry: Entry) -> None:
        """``entry`` (a permit's) ended: its node counts for nothing any more, which may
        let requests waiting here in (those are woken), and its own wait ends."""
        node = entry.path.rsplit("/", 1)[1]
        if len(self.dead) >= DEAD_LIMIT:
            del self.dead[next(iter(self.dead))]
        self.dead[node] = None
        self.mirrors.ended(entry.name, node)
        self.forget(entry.name, entry.owner)  # (a lost session's requests are not released)
        reserved = self.reserved.get(entry.name)
        if reserved:
            listed = self.views.get(entry.name)
            if listed is not None:
                passed(self, entry.name, self.live(listed))
        waiting = self.waiting.get(entry.name)
        if not waiting:
            return
        wake = waiting.get(entry.owner)
        if wake is not None and not wake.done():
            wake.set_result(None)
        listed = self.views.get(entry.name)
        if listed is not None:
            queue = self.live(listed)
            self._wake(entry.name, queue, fitting(queue))

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
                identity, metadata, held, told = decode_permit(reply.data)
            except (ValueError, UnicodeDecodeError) as exc:
                raise foreign_permit(
                    name, node.node, f"its data is not aiolease's ({exc})"
                ) from None
            token = int(reply.stat.last_modified_zxid) if told is None else told
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
                identity, metadata, held, _ = decode_permit(mine.data)
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

    # -- release -------------------------------------------------------------------------

    def release_now(self, entry: Entry) -> Awaitable[bool] | None:
        """Release ``entry`` (a permit held here): see :func:`._permit_hand_off.release_now`."""
        return release_now(self, entry)

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
        key = (name, owner)
        entry = self.keeper.entries.get(key)
        turn = self.turns.get(key)
        busy = self.busy.get(key)
        if busy is not None:  # a release is granting it
            await asyncio.wait([busy], timeout=ttl / 2)
            return
        if entry is None or not entry.queued or turn is None or key in self.fits:
            return
        entry.horizon = max(entry.horizon, now() + QUEUE_HORIZON * ttl)
        self.keeper.poke(entry.horizon)
        local = self._local_turn(entry)
        if local is not None and local:
            return  # it fits (the view its retry is handed shows it)
        loop = asyncio.get_running_loop()
        wake: asyncio.Future[None] = loop.create_future()
        waiting = self.waiting.setdefault(name, {})
        waiting[owner] = wake
        try:
            if local is None:
                await self._wait_turn(entry, name, turn, wake, closed, ttl / 2)
            elif not closed.is_set():
                # Only nodes of this backend are before it: what lets it in is done
                # here (a release, or an entry's end, wakes it): no watch, no request.
                timer = loop.call_later(ttl / 2, settle, wake)
                try:
                    await wake
                finally:
                    timer.cancel()
        finally:
            if waiting.get(owner) is wake:
                del waiting[owner]
            if not waiting and self.waiting.get(name) is waiting:
                del self.waiting[name]

    def _local_turn(self, entry: Entry) -> bool | None:
        """From the name's view, without a request: ``True`` if ``entry`` fits (its
        retry is then handed that view); ``False`` if it does not and every node before
        it is a live entry of this backend (so only this backend can let it in);
        ``None`` if the view cannot tell (a wait must watch)."""
        name = entry.name
        listed = self.views.get(name)
        if listed is None:
            return None
        queue = self.live(listed)
        node = entry.path.rsplit("/", 1)[1]
        index = next((i for i, n in enumerate(queue) if n.node == node), None)
        if index is None:
            return None
        if fitting(queue) > index:
            if len(self.fits) >= TURNS_LIMIT:
                del self.fits[next(iter(self.fits))]
            self.fits[(name, entry.owner)] = queue
            return True
        sid = self.wire.session_id
        for ahead in queue[:index]:
            mine = self.keeper.entries.get((name, ahead.owner))
            if (
                mine is None
                or mine.reason is not None
                or mine.session_id != sid
                or not mine.path.endswith(ahead.node)
            ):
                return None
        return False

    def closing(self) -> None:
        """The backend closes: every wait here ends."""
        for waiting in self.waiting.values():
            for wake in waiting.values():
                settle(wake)

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


def _place(queue: list[PermitNode], entry: Entry) -> int | None:
    """Where ``entry``'s node is in ``queue`` (``None``: not there)."""
    node = entry.path.rsplit("/", 1)[1]
    for index, listed in enumerate(queue):
        if listed.node == node:
            return index
    return None
