"""ZooKeeperBackend: the contract of :mod:`aiolease.abc` on ZooKeeper (see the package
docstring)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiozk import protocol
from aiozk.exc import NoNode

from ..._exceptions import (
    BackendUnavailable,
    ForeignDataError,
    InvalidArgument,
    LossReason,
    NotOwnerError,
)
from ..._permits import PermitHolders, is_permit_owner
from ..._records import state_of
from ..._validate import check_seconds
from ...abc import Backend, Capability, Grant, HolderInfo
from .._asyncio import now, timeout_after, wait_any
from ._nodes import DEFAULT_PREFIX, Contender, Layout, decode_data, encode_data
from ._permits import Permits
from ._session import Entry, Keeper
from ._stats import ZooKeeperStatistics
from ._url import DEFAULT_TIMEOUT, check_path, client_of, number_option, parse_url
from ._wire import Wire

__all__ = ["ZooKeeperBackend"]

#: Seconds a node queued by a refused ``try_acquire`` is kept unless ``wait_turn``
#: follows (the core calls it at once, or releases; a bare ``try_acquire`` does neither).
TURN_GRACE = 0.5
#: A queued attempt is dropped after this many ttls without a retry.
QUEUE_HORIZON = 2.0
#: How many names' last seen holders are remembered for ``wait_changed``.
SEEN_LIMIT = 4096
#: Attempts at reading the first contender while the queue moves under the read.
READ_ATTEMPTS = 20

CAPABILITIES = frozenset(
    {
        Capability.PUSH_WAKEUP,
        Capability.FAIR_QUEUE,
        Capability.SERVER_TIME,
        Capability.DURABLE_TOKENS,
        Capability.SESSION,
        Capability.MULTI_PROCESS,
        Capability.PROCLAIM,
        Capability.SEMAPHORE,
        Capability.FAIR_PERMITS,
    }
)


class ZooKeeperBackend(Backend):
    """Leases as ephemeral sequential nodes of one ZooKeeper session.

    :param client: an ``aiozk.ZKClient`` to talk through (started on first use if it is
        not; never closed by the backend). :meth:`from_url` builds one of its own.
    :param prefix: the node (under the client's chroot) that holds the leases
    :param timeout: seconds one request may take
    :raises InvalidArgument: a bad option
    """

    requires_asyncio = True

    def __init__(
        self, client: Any, *, prefix: str = DEFAULT_PREFIX, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        timeout = check_seconds("timeout", timeout)
        hosts = getattr(getattr(client, "session", None), "hosts", "?")
        described = f"<client of {hosts}>"
        self._setup(Wire(client, timeout, described, owned=False), "", prefix)

    def _setup(self, wire: Wire, chroot: str, prefix: object) -> None:
        if not isinstance(prefix, str):
            raise InvalidArgument(f"ZooKeeper prefix must be a str, not {type(prefix).__name__}")
        base = check_path("prefix", prefix)
        if not base:
            raise InvalidArgument(
                f"ZooKeeper prefix must name a node (the default is {DEFAULT_PREFIX!r})"
            )
        self._wire = wire
        self._prefix = prefix
        self._layout = Layout(chroot + base)
        self._keeper = Keeper(wire, self._layout.base)
        self._permits = Permits(wire, self._keeper, self._layout.base, self._grant)
        self._keeper.on_end = self._ended
        self._seen: dict[str, tuple[object, str]] = {}
        #: Attempts whose create may have been applied without its reply seen.
        self._unsure: set[tuple[str, str]] = set()
        #: Names that had other contenders when last listed: a new attempt looks first.
        self._crowded: dict[str, None] = {}
        #: Refused attempts (their nodes deleted): the data wait_turn queues them with.
        self._refused: dict[tuple[str, str], bytes] = {}
        #: Nodes this backend held (each the first of its queue) and released.
        self._heads: dict[str, None] = {}
        #: A released head's path -> the entry of this backend waiting for its delete
        #: to be answered (the next holder: see :meth:`_wait_predecessor`).
        self._successors: dict[str, Entry] = {}
        self._hand_offs = 0
        self._local_refusals = 0
        self._started = False
        self._closed = False

    def __repr__(self) -> str:
        return f"<ZooKeeperBackend {self._wire.described} prefix={self._prefix!r}>"

    @property
    def prefix(self) -> str:
        """The node that holds the leases."""
        return self._prefix

    capabilities = CAPABILITIES

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> ZooKeeperBackend:
        """Connect to ``zookeeper://host[:port][,host[:port]...][/chroot][?options]``.

        See :mod:`aiolease.backends.zookeeper` for the options.

        :raises InvalidArgument: a malformed URL or option
        :raises BackendUnavailable: no server answers
        """
        parsed = parse_url(url, options)
        settings = dict(parsed.options)
        timeout = check_seconds("timeout", number_option("timeout", settings.pop("timeout", None)))
        session_timeout = check_seconds(
            "session_timeout",
            number_option("session_timeout", settings.pop("session_timeout", None)),
        )
        prefix = settings.pop("prefix", DEFAULT_PREFIX)
        self = cls.__new__(cls)
        client = client_of(parsed.connect_string(), session_timeout, timeout)
        self._setup(Wire(client, timeout, parsed.described(), owned=True), parsed.chroot, prefix)
        try:
            await self._start()
        except BaseException:
            await self._wire.aclose()
            raise
        return self

    def statistics(self) -> ZooKeeperStatistics:
        """A frozen snapshot of the session and its counters."""
        k = self._keeper
        return ZooKeeperStatistics(
            self._wire.session_id,
            self._wire.negotiated,
            len(k.entries),
            self._wire.requests,
            k.pings,
            k.ping_failures,
            k.lost_sessions,
            k.expired_entries,
            self._hand_offs,
            self._local_refusals,
            self._permits.hand_offs,
        )

    async def _start(self) -> None:
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        if self._started:
            return
        await self._wire.start()
        await self._ensure(self._layout.base)
        self._keeper.start()
        self._started = True

    async def _ensure(self, path: str) -> None:
        """Create the persistent node ``path`` and its parents, where missing."""
        parts = path.strip("/").split("/")
        requests = [
            self._wire.create(
                self._wire.path("/" + "/".join(parts[: i + 1])),
                b"",
                sequence=False,
                ephemeral=False,
                container=False,
            )
            for i in range(len(parts))
        ]
        await self._wire.send(*requests)  # NodeExists answers are fine

    def _grant(self, entry: Entry, ttl: float) -> Grant:
        """The grant of ``entry`` (it holds the name) for ``ttl``."""
        entry.queued = False
        granted = min(ttl, self._wire.negotiated)
        return Grant(entry.token, granted, self._wire.expires - granted)

    # -- try_acquire ------------------------------------------------------------------------

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        await self._start()
        for _ in range(READ_ATTEMPTS):
            outcome = await self._attempt(name, owner, ttl, identity, metadata)
            if outcome is not None:
                return outcome
        raise BackendUnavailable(f"ZooKeeper: the queue of {name!r} moved under every attempt")

    async def _attempt(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo | None:
        """One try: a grant, the holder, or ``None`` (the queue moved: try again)."""
        touched = now()
        key = (name, owner)
        entry = self._keeper.entries.get(key)
        if entry is None and key in self._unsure:
            entry = await self._find(name, owner, touched, ttl)
        fresh = entry is None
        if entry is not None and entry.first and entry.reason is None:
            # The head just before it went (see wait_turn): first, no listing needed.
            entry.first = False
            self._hand_offs += 1
            return self._granted(name, entry, ttl, touched)
        if entry is None and key not in self._unsure:
            here = self._held_here(name)
            if here is not None:
                # Held through this backend (or being handed to a waiter of it): refused
                # without a request, and without a write.
                self._local_refusals += 1
                self._note_refused(name, owner, encode_data(identity, metadata))
                return here
        if entry is None and name in self._crowded and key not in self._unsure:
            # Held when last seen: look before writing (a refusal then writes nothing).
            queue = await self._queue(name)
            holder = await self._holder(name, queue)
            if holder is not None:
                self._note_refused(name, owner, encode_data(identity, metadata))
                return holder
            self._crowded.pop(name, None)
        if entry is None:
            data = encode_data(identity, metadata)
            entry, queue = await self._enqueue(name, owner, data, touched, touched + ttl)
        else:
            queue = await self._queue(name)
        self._note_crowd(name, len(queue) > 1)
        paths = [self._layout.path(name, c.node) for c in queue]
        if entry.reason is not None or entry.path not in paths:
            # Our node is gone (expired, or with its session): start over.
            self._keeper.end(entry, LossReason.EXPIRED)
            return None
        index = paths.index(entry.path)
        if index > 0:
            # The first of those ahead that is still there holds the name. Nodes only
            # join at the end of the queue: when all of them are gone, ours is first.
            if fresh:
                # Refused: a node that could become first without its owner asking
                # would hold the name for nobody. wait_turn queues one again.
                self._note_refused(name, owner, encode_data(identity, metadata))
                self._keeper.end(entry, LossReason.RELEASED)
                self._unsure.add(key)  # until its delete is answered
                holder = await self._holder(name, queue[:index], also=entry.path)
                self._unsure.discard(key)
                return holder
            entry.horizon = max(entry.horizon, touched + TURN_GRACE)
            entry.predecessor, entry.predecessor_first = paths[index - 1], index == 1
            self._keeper.poke(entry.horizon)
            holder = await self._holder(name, queue[:index])
            if holder is not None:
                return holder
        return self._granted(name, entry, ttl, touched)

    def _granted(self, name: str, entry: Entry, ttl: float, touched: float) -> Grant | None:
        """Grant ``entry``, the first of its queue (``None``: its session is gone)."""
        if entry.session_id != self._wire.session_id:
            # Our node rode on a session the server has expired since (ephemeralOwner).
            self._keeper.end(entry, LossReason.STOLEN)
            return None
        entry.queued = False
        if entry.horizon != math.inf:
            entry.horizon = touched + ttl
            self._keeper.poke(entry.horizon)
        self._remember(name, entry, entry.path)  # its state worked out if a wait asks
        return self._grant(entry, ttl)

    def _held_here(self, name: str) -> HolderInfo | None:
        """The holder of ``name`` when this backend knows it without asking: a live
        grant of its own session, or, while the delete of such a grant it released is
        in flight, the entry of its own waiting for that delete (queued before anyone
        who asks now: the next holder, unless it gives up first)."""
        known = self._seen.get(name)
        if known is None or not isinstance(known[0], Entry):
            return None
        head: Entry | None = known[0]
        assert head is not None
        if head.reason is LossReason.RELEASED and head.path in self._heads:
            head = self._successors.get(head.path)
            if head is None or not head.queued:
                return None
        elif head.queued:
            return None
        if self._live_entry(name, head.path) is not head:
            return None
        contender = self._layout.contender(name, head.path.rsplit("/", 1)[1])
        return self._layout.holder(name, contender, head.data, head.token, None)

    def _note_crowd(self, name: str, crowded: bool) -> None:
        """Remember whether ``name`` had other contenders when last listed (a hint)."""
        if not crowded:
            self._crowded.pop(name, None)
            return
        if len(self._crowded) >= SEEN_LIMIT and name not in self._crowded:
            del self._crowded[next(iter(self._crowded))]
        self._crowded[name] = None

    def _note_refused(self, name: str, owner: str, data: bytes) -> None:
        """``owner`` was refused (its node deleted): what ``wait_turn`` queues it with."""
        if len(self._refused) >= SEEN_LIMIT:
            del self._refused[next(iter(self._refused))]
        self._refused[(name, owner)] = data

    async def _enqueue(
        self, name: str, owner: str, data: bytes, touched: float, horizon: float
    ) -> tuple[Entry, list[Contender]]:
        """Create ``owner``'s contender node and list the queue (one round trip)."""
        path = self._wire.path(self._layout.new_node(name, owner))
        parent = self._wire.path(self._layout.name_node(name))
        self._unsure.add((name, owner))
        created, listed = await self._wire.create_and_list(path, parent, data)
        node = created.path.rsplit("/", 1)[1]
        entry = Entry.created(
            name,
            owner,
            created,
            self._layout.path(name, node),
            self._wire.session_id,
            horizon,
            data,
        )
        self._keeper.attach(entry)
        self._unsure.discard((name, owner))
        self._refused.pop((name, owner), None)
        if isinstance(listed, Exception):
            return entry, await self._queue(name)
        return entry, self._layout.queue(name, listed.children)

    async def _find(self, name: str, owner: str, touched: float, ttl: float) -> Entry | None:
        """``owner``'s node of ``name`` from a request whose reply was lost, if it exists
        and is of this backend's session (Curator's protected mode)."""
        head = self._layout.owner_head(owner)
        parent = self._wire.path(self._layout.name_node(name))
        (listed,) = await self._wire.send(self._wire.children(parent))
        if isinstance(listed, Exception):
            self._unsure.discard((name, owner))
            return None
        mine = [c for c in listed.children if c.startswith(head)]
        found = None
        for node in mine:
            path = self._layout.path(name, node)
            (stat,) = await self._wire.send(self._wire.exists(self._wire.path(path)))
            if isinstance(stat, Exception):
                continue
            if stat.stat.ephemeral_owner != self._wire.session_id or found is not None:
                continue  # another session's (a lost one): never taken for ours
            contender = self._layout.contender(name, node)
            found = Entry(
                name,
                owner,
                int(stat.stat.created_zxid),
                contender.sequence,
                path,
                self._wire.session_id,
                touched + ttl,
            )
            self._keeper.attach(found)
        self._unsure.discard((name, owner))
        return found

    async def _queue(self, name: str, watch: bool = False) -> list[Contender]:
        """The contenders of ``name`` in order (empty if it has no node)."""
        parent = self._wire.path(self._layout.name_node(name))
        (listed,) = await self._wire.send(self._wire.children(parent, watch))
        if isinstance(listed, Exception):
            return []
        return self._layout.queue(name, listed.children)

    async def _holder(
        self, name: str, queue: list[Contender], also: str | None = None
    ) -> HolderInfo | None:
        """The holder: the first contender of ``queue`` still there (``None``: every one
        of them went meanwhile). ``also``: a node to delete in the same round trip."""
        extra = [] if also is None else [self._wire.delete(self._wire.path(also))]
        for first in queue:
            path = self._layout.path(name, first.node)
            mine = self._keeper.entries.get((name, first.owner))
            if mine is not None and mine.path == path and mine.data:
                # A node of this backend's, listed just now: what it holds is known here.
                if extra:
                    await self._wire.send(*extra)
                holder = self._layout.holder(name, first, mine.data, mine.token, None)
                self._remember(name, state_of(holder), path)
                return holder
            (data, *_) = await self._wire.send(self._wire.get(self._wire.path(path)), *extra)
            extra = []
            if isinstance(data, Exception):
                continue  # deleted since the listing: the next one may hold
            token = int(data.stat.created_zxid)
            # No remaining ttl: the node lives as long as its session, which only its
            # own client can tell.
            holder = self._layout.holder(name, first, data.data, token, None)
            self._remember(name, state_of(holder), path)
            return holder
        if extra:
            await self._wire.send(*extra)
        return None

    def _remember(self, name: str, identity: object, path: str) -> None:
        self._seen.pop(name, None)
        if len(self._seen) >= SEEN_LIMIT:
            del self._seen[next(iter(self._seen))]
        self._seen[name] = (identity, path)

    # -- renew, hold, release -----------------------------------------------------------------

    def _held(self, name: str, owner: str, token: int) -> Entry:
        entry = self._keeper.entries.get((name, owner))
        if entry is None or entry.token != token or entry.queued or entry.reason is not None:
            raise NotOwnerError(name)
        return entry

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        """Local bookkeeping: the session's pings keep the node; this moves its horizon.

        :raises NotOwnerError: ``owner`` does not hold ``name`` through this backend
        """
        await self._start()
        touched = now()
        entry = self._held(name, owner, token)
        if entry.horizon <= touched:
            raise NotOwnerError(name)
        if entry.horizon != math.inf:
            entry.horizon = touched + ttl
            self._keeper.poke(entry.horizon)
        return self._grant(entry, ttl)

    def hold(
        self, name: str, owner: str, token: int, ended: Callable[[LossReason], object]
    ) -> Keeper:
        """The core holds ``owner``'s grant: keep its node for as long as the session
        lives, until released; ``ended(reason)`` when lost.

        :raises NotOwnerError: the grant is not (any more) held through this backend
        """
        entry = self._held(name, owner, token)
        entry.horizon = math.inf
        entry.callbacks.append(ended)
        return self._keeper

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        if self._closed:
            return False
        await self._start()
        entry = self._keeper.entries.get((name, owner))
        if is_permit_owner(owner):
            self._permits.forget(name, owner)
        if entry is not None and entry.queued and is_permit_owner(owner):
            token = None  # a queued permit request leaves the queue whatever token is given
        if entry is not None and (token is None or entry.token == token):
            queued = entry.queued
            if not queued and is_permit_owner(owner):
                sent = self._permits.release_now(entry)
                if sent is not None:
                    return await sent
            if not queued:
                self._head_released(entry.path)
            self._keeper.end(entry, LossReason.RELEASED, quietly=True)
            deleted = await self._deleted(
                self._wire.send(self._wire.delete(self._wire.path(entry.path))), entry
            )
            return deleted and not queued
        if entry is not None:
            return False
        if is_permit_owner(owner):
            return await self._permits.release_unknown(name, owner, token)
        if self._refused.pop((name, owner), None) is not None and (name, owner) not in self._unsure:
            return False  # refused, its node deleted then: nothing to free
        return await self._release_unknown(name, owner, token)

    def release_now(self, name: str, owner: str, token: int) -> Awaitable[bool] | None:
        """:meth:`release` of a grant this backend holds, its delete written before
        returning; ``None`` (the core awaits :meth:`release`) otherwise."""
        entry = self._keeper.entries.get((name, owner))
        if self._closed or entry is None or entry.token != token or entry.queued:
            return None
        if is_permit_owner(owner):
            self._permits.forget(name, owner)
            return self._permits.release_now(entry)
        self._head_released(entry.path)  # (before the delete: its successor's watch fires)
        replies = self._wire.send_now(self._wire.delete(self._wire.path(entry.path)))
        if replies is None:
            return None
        self._keeper.end(entry, LossReason.RELEASED, quietly=True)
        return self._deleted(replies, entry)

    def _ended(self, entry: Entry) -> None:
        """Every entry's end (the keeper's hook): a permit's may let others in."""
        if is_permit_owner(entry.owner):
            self._permits.ended(entry)

    def _head_released(self, path: str) -> None:
        """Note that the node at ``path``, held here (so the first of its queue), is
        being deleted: a waiter whose predecessor it was is first once it is gone."""
        if len(self._heads) >= SEEN_LIMIT:
            del self._heads[next(iter(self._heads))]
        self._heads[path] = None

    async def _deleted(self, replies: Awaitable[list[Any]], entry: Entry) -> bool:
        """Whether the delete of ``entry``'s node freed it. One whose reply did not come
        is deleted again by the keeper (the session may live on, and the node with it)."""
        try:
            (deleted,) = await replies
        except BaseException:
            self._keeper.zombies[entry.path] = entry.session_id
            raise
        return not isinstance(deleted, Exception)

    async def _release_unknown(self, name: str, owner: str, token: int | None) -> bool:
        """Release a node this backend does not track (a create whose reply was lost, or
        one of another backend object): by owner and token, found by name."""
        head = self._layout.owner_head(owner)
        parent = self._wire.path(self._layout.name_node(name))
        (listed,) = await self._wire.send(self._wire.children(parent))
        if isinstance(listed, Exception):
            self._unsure.discard((name, owner))
            return False
        queue = self._layout.queue(name, listed.children)
        freed = False
        for index, contender in enumerate(queue):
            if not contender.node.startswith(head):
                continue
            path = self._wire.path(self._layout.path(name, contender.node))
            if token is not None:
                (stat,) = await self._wire.send(self._wire.exists(path))
                if isinstance(stat, Exception) or int(stat.stat.created_zxid) != token:
                    continue
            zombie = self._keeper.zombies.pop(self._layout.path(name, contender.node), None)
            (deleted,) = await self._wire.send(self._wire.delete(path))
            # A node of a lease already lost here frees nothing the caller held.
            freed = freed or (index == 0 and zombie is None and not isinstance(deleted, Exception))
        self._unsure.discard((name, owner))
        return freed

    # -- read and waits ------------------------------------------------------------------------

    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        """Write the node of ``owner``'s grant (held through this backend) anew with
        ``metadata``: its zxid of creation, the token, stays. Watchers of the node see
        its data change.

        :raises NotOwnerError: ``owner`` does not hold ``name`` through this backend, or
            its node is gone
        """
        await self._start()
        if is_permit_owner(owner):
            raise NotOwnerError(name, f"{name!r}: a permit's metadata is not rewritten")
        entry = self._held(name, owner, token)
        identity, _ = decode_data(entry.data)
        data = encode_data(identity, metadata)
        (written,) = await self._wire.send(self._wire.set_data(self._wire.path(entry.path), data))
        if isinstance(written, Exception):
            raise NotOwnerError(name, f"lease {name!r}: its node is gone ({written!r})")
        entry.data = data  # what _holder answers from

    async def read(self, name: str) -> HolderInfo | None:
        await self._start()
        for _ in range(READ_ATTEMPTS):
            queue = await self._queue(name)
            if not queue:
                self._remember(name, None, "")
                return None
            holder = await self._holder(name, queue)
            if holder is not None:
                return holder
        raise BackendUnavailable(f"ZooKeeper: the queue of {name!r} moved under every read")

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        """Watch the holder's node go or change (or, when free, the name's children
        change)."""
        await self._start()
        expected = state_of(seen)
        known = self._seen.get(name)
        if known is None or _state(known[0]) != expected:
            if state_of(await self.read(name)) != expected:
                return
            known = self._seen[name]
        # Bounded: aiozk does not set a deleted-node watch again after a reconnect.
        bound = max(self._wire.negotiated, 1.0)
        if seen is None:
            await self._wait_children(name, bound)
        else:
            await self._wait_gone(known[1], bound, holder=(name, expected))

    async def _wait_gone(
        self, path: str, bound: float, holder: tuple[str, object] | None = None
    ) -> bool:
        """Return when the node at ``path`` is deleted (or is gone already), or its data
        changes (the holder's new metadata); with ``holder`` (a name and the state of its
        holder as the caller knew it), also when the holder differs once the watch is
        set (what was known of it may predate a rewrite). Whether the node is gone, as
        this session was told (so while it lived)."""
        full = self._wire.path(path)
        fired, stop = self._wire.watch(protocol.WatchEvent.DELETED, full)
        rewritten, stop_rewritten = self._wire.watch(protocol.WatchEvent.DATA_CHANGED, full)
        try:
            (stat,) = await self._wire.send(self._wire.exists(full, watch=True))
            if isinstance(stat, NoNode):
                return True
            if isinstance(stat, Exception):
                return False
            # Its data was rewritten (a proclaim), maybe after what was known of it:
            # compare once the watch is set. (Never rewritten: nothing to compare.)
            if holder is not None and stat.stat.version:
                name, expected = holder
                if state_of(await self.read(name)) != expected:
                    return False
            await wait_any([fired, rewritten], self._keeper.wake_closed, bound)
            return fired.done() and not fired.cancelled() and fired.exception() is None
        finally:
            stop()
            stop_rewritten()

    async def _wait_children(self, name: str, bound: float) -> None:
        """Return when the children of ``name``'s node change (or it is created)."""
        parent = self._wire.path(self._layout.name_node(name))
        changed, stop = self._wire.watch(protocol.WatchEvent.CHILDREN_CHANGED, parent)
        created, stop_created = self._wire.watch(protocol.WatchEvent.CREATED, parent)
        try:
            (listed,) = await self._wire.send(self._wire.children(parent, watch=True))
            if isinstance(listed, Exception):
                (stat,) = await self._wire.send(self._wire.exists(parent, watch=True))
                if not isinstance(stat, Exception):
                    return  # created meanwhile
                await self._wait_fired(created, bound)
            elif listed.children:
                return
            else:
                await self._wait_fired(changed, bound)
        finally:
            stop()
            stop_created()

    async def _wait_fired(self, fired: asyncio.Future[None], bound: float) -> None:
        """Wait for ``fired``, the backend closing, or ``bound`` seconds."""
        await wait_any([fired], self._keeper.wake_closed, bound)

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Queue ``owner``'s node (if it is not queued), then watch only its predecessor."""
        await self._start()
        touched = now()
        horizon = touched + QUEUE_HORIZON * ttl
        entry = self._keeper.entries.get((name, owner))
        if entry is None:
            data = self._refused.get((name, owner))
            if data is None:
                return  # not refused here: the retry queues it (or finds it holds)
            entry, queue = await self._enqueue(name, owner, data, touched, horizon)
            paths = [self._layout.path(name, c.node) for c in queue]
            index = paths.index(entry.path) if entry.path in paths else 0
            entry.predecessor = paths[index - 1] if index > 0 else None
            entry.predecessor_first = index == 1
        elif not entry.queued:
            return
        entry.horizon = max(entry.horizon, horizon)
        self._keeper.poke(entry.horizon)
        ahead = entry.predecessor
        if ahead is not None and await self._wait_predecessor(name, owner, ahead, ttl / 2):
            # Nodes only join at the end: the one just before it, once the first (held
            # here, or listed first), is gone, so it is first now (while its session
            # lives: the retry checks that). Of this session, its delete written is
            # enough: this session's later requests are applied after it, and every
            # other session's node is behind this one, so none of them can hold before
            # this grant ends; the one whose node is still first for a moment has left
            # its block (or never entered it).
            entry.first = ahead in self._heads or entry.predecessor_first

    async def _wait_predecessor(self, name: str, owner: str, path: str, bound: float) -> bool:
        """:meth:`_wait_gone` of the contender node at ``path``; but when it is a live
        node of this backend's session, wait until this backend writes its delete
        instead (every delete of an entry's node follows the entry's end, so it has not
        been written yet): no watch to set, no round trip."""
        if self._live_entry(name, path) is None:
            return await self._wait_gone(path, bound)
        waiting = self._keeper.entries.get((name, owner))
        full = self._wire.path(path)
        gone = self._wire.deleted(full)
        timer = asyncio.get_running_loop().call_later(bound, _settle, gone, False)
        if waiting is not None:
            self._successors[path] = waiting
        try:
            return await gone
        finally:
            timer.cancel()
            self._wire.forget(full, gone)
            if waiting is not None and self._successors.get(path) is waiting:
                del self._successors[path]

    def _live_entry(self, name: str, path: str) -> Entry | None:
        """The entry of this backend's session whose node is at ``path``, if it lives."""
        try:
            contender = self._layout.contender(name, path.rsplit("/", 1)[1])
        except ForeignDataError:
            return None
        entry = self._keeper.entries.get((name, contender.owner))
        if (
            entry is None
            or entry.path != path
            or entry.reason is not None
            or entry.session_id != self._wire.session_id
        ):
            return None
        return entry

    # -- permits (docs/internals/semaphores.md; see ._permits) ---------------------------

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
        """Create ``owner``'s permit node and list the name's: granted iff the weights of
        the nodes before it and its own fit in ``limit`` (FIFO); else it stays queued."""
        await self._start()
        return await self._permits.try_acquire(name, owner, ttl, identity, metadata, limit, weight)

    async def read_permits(self, name: str) -> PermitHolders | None:
        await self._start()
        return await self._permits.read(name)

    async def wait_permit_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Watch the nodes before ``owner``'s (the first in line) or only the node before
        ``owner``'s (any later waiter), for at most half of ``ttl``."""
        await self._start()
        await self._permits.wait_turn(name, owner, ttl, self._keeper.wake_closed)

    async def wait_lost(self, name: str, owner: str, token: int) -> LossReason:
        entry = self._keeper.entries.get((name, owner))
        if entry is None or entry.token != token:
            return LossReason.STOLEN
        return await entry.wait_ended()

    async def aclose(self) -> None:
        """Delete this backend's nodes and close what it opened (a client it opened:
        its session, and every node with it)."""
        if self._closed:
            return
        self._closed = True
        self._keeper.closing()
        self._permits.closing()
        self._wire.wake_deleted()
        try:
            if self._started and not self._wire.owned:
                paths = [e.path for e in self._keeper.entries.values()]
                for entry in list(self._keeper.entries.values()):
                    self._keeper.end(entry, LossReason.SHUTDOWN)
                if paths:
                    try:
                        async with timeout_after(self._wire.timeout):
                            await self._wire.send(
                                *(self._wire.delete(self._wire.path(p)) for p in paths)
                            )
                    except (asyncio.TimeoutError, BackendUnavailable):
                        pass  # they go with the session
            await self._keeper.stop()
        finally:
            await self._wire.aclose()


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


def _state(entry: object) -> object:
    """What :func:`state_of` says of the holder ``entry`` stands for, if it is an
    :class:`Entry` (an object equal to nothing if its data cannot be read: a wait then
    reads first); else ``entry`` itself (a state already)."""
    if not isinstance(entry, Entry):
        return entry
    try:
        _, metadata = decode_data(entry.data)
    except ValueError:
        return object()
    return (entry.owner, entry.token, tuple(sorted(metadata.items())))
