"""EtcdBackend: the contract of :mod:`aiolease.abc` on etcd v3 (see the package docstring)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from aetcd import rpc

from ..._exceptions import (
    BackendError,
    BackendUnavailable,
    ForeignDataError,
    InvalidArgument,
    LimitMismatchError,
    LossReason,
    NotOwnerError,
)
from ..._permits import is_permit_owner
from ..._records import state_of
from ..._validate import check_seconds
from ...abc import Capability, Grant, HolderInfo
from .._asyncio import now
from ._aio import finishing, shielded
from ._channel import open_channel, seconds
from ._handoff import Handoffs
from ._keys import DEFAULT_PREFIX, Layout, decode_value, encode_value, with_owner
from ._permit_ops import PermitOps
from ._permit_watch import PermitWatches
from ._session import QUEUE_HORIZON, SEEN_LIMIT, Entry, Session, Sessions
from ._slots import Slots
from ._stats import EtcdStatistics
from ._takeover import Takeovers
from ._url import parse_bool, parse_url
from ._wire import SessionGone, Wire

__all__ = ["EtcdBackend"]

logger = logging.getLogger("aiolease.backends.etcd")

#: Seconds one request may take, unless ``timeout`` says otherwise.
DEFAULT_TIMEOUT = 5.0
#: Seconds a session lease without leases on it is kept before it is revoked.
DEFAULT_SESSION_IDLE = 30.0
#: After this many request timeouts, a request whose reply was never seen is taken
#: to be either applied or dropped by the server (for good).
LATE_AFTER = 2.0
#: Seconds a cancelled caller still waits for the reply to a request that may write.
CANCEL_GRACE = 1.0
#: Fair mode: seconds a key queued by a refused ``try_acquire`` is kept unless
#: ``wait_turn`` follows (the core calls it at once; a bare ``try_acquire`` does not).
TURN_GRACE = 0.5
T = TypeVar("T")

#: What was last read of a name: the holder's state (:func:`state_of`), the revision,
#: the holder's key.
_Seen = tuple[object, int, bytes]


def _any_event(events: Sequence[Any]) -> bool:
    return True


def _touch(entry: Entry, horizon: float) -> None:
    """Reset the horizon of ``entry`` (not of one the core holds: that has none)."""
    if entry.horizon != math.inf:
        entry.horizon = horizon


#: What every instance guarantees (fair mode adds :attr:`Capability.FAIR_QUEUE`).
CAPABILITIES = frozenset(
    {
        Capability.PUSH_WAKEUP,
        Capability.SERVER_TIME,
        Capability.DURABLE_TOKENS,
        Capability.SESSION,
        Capability.MULTI_PROCESS,
        Capability.PROCLAIM,
        Capability.SEMAPHORE,
        Capability.FAIR_PERMITS,
        Capability.PERMIT_RETRY_KEEPS_ENTRY,
    }
)


class EtcdBackend(PermitOps):
    """Leases in etcd v3, riding on one session lease per ttl.

    :param client: an ``aetcd.Client`` to talk through (connected on first use; never
        closed by the backend). :meth:`from_url` builds a connection of its own.
    :param prefix: the key prefix (default ``aiolease/``)
    :param fair: grant waiters in arrival order (:attr:`Capability.FAIR_QUEUE`)
    :param timeout: seconds one request may take
    :param session_idle: seconds a session lease that carries nothing is kept
    :raises InvalidArgument: a bad option
    """

    requires_asyncio = True

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = DEFAULT_PREFIX,
        fair: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        session_idle: float = DEFAULT_SESSION_IDLE,
    ) -> None:
        timeout = check_seconds("timeout", timeout)
        self._setup(Wire.of_client(client, timeout), prefix, fair, session_idle)

    def _setup(self, wire: Wire, prefix: object, fair: object, idle: object) -> None:
        if not isinstance(prefix, str):
            raise InvalidArgument(f"etcd prefix must be a str, not {type(prefix).__name__}")
        if not prefix:
            # etcd has no empty key: the first read would fail as "key is not provided".
            raise InvalidArgument(
                f"etcd prefix must not be empty (the default is {DEFAULT_PREFIX!r})"
            )
        self._wire = wire
        self._prefix = prefix
        self._layout = Layout(prefix.encode())
        self._fair = parse_bool("fair", fair)
        self._sessions = Sessions(wire, check_seconds("session_idle", idle, allow_zero=True))
        self._sessions.set_deleter(self._delete_expired)
        self._takeovers = Takeovers(wire, self._layout, self._sessions.spawn, self._taken)
        self._sessions.set_dropped(self._takeovers.unwatch)
        self._permit_watches = PermitWatches(wire, self._layout, self._sessions.spawn)
        self._seen: dict[str, _Seen] = {}
        self._slots = Slots(self._fair)
        self._values: dict[tuple[str, str], bytes] = {}
        #: Fair mode: the predecessor of a key queued by a refused ``try_acquire`` (if
        #: any), and the revision at which it was read (the key's token).
        self._turns: dict[tuple[str, str], tuple[Any, int]] = {}
        self._handoffs = Handoffs()
        #: Per refused permit request: what its wait needs (see ``_permit_ops._Turn``).
        self._permit_seen = {}
        self._permit_queued = {}
        self._permit_handed = {}
        self._permit_ready = {}
        self._closed = False

    def __repr__(self) -> str:
        fair = " fair" if self._fair else ""
        return f"<EtcdBackend {self._wire.described} prefix={self._prefix!r}{fair}>"

    @property
    def prefix(self) -> str:
        """The key prefix."""
        return self._prefix

    @property
    def capabilities(self) -> frozenset[Capability]:
        """:data:`CAPABILITIES`, and :attr:`Capability.FAIR_QUEUE` in fair mode."""
        fair = frozenset({Capability.FAIR_QUEUE}) if self._fair else frozenset()
        return CAPABILITIES | fair

    @property
    def fair(self) -> bool:
        """Whether waiters are granted in arrival order."""
        return self._fair

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> EtcdBackend:
        """Connect to ``etcd://[user[:password]@]host[:port][,host[:port]...][?options]``.

        See :mod:`aiolease.backends.etcd` for the options.

        :raises InvalidArgument: a malformed URL or option
        :raises BackendUnavailable: no endpoint answers, or the login is refused
        """
        parsed = parse_url(url, options)
        settings = dict(parsed.options)
        timeout = seconds("timeout", settings.pop("timeout", DEFAULT_TIMEOUT))
        idle = seconds("session_idle", settings.pop("session_idle", DEFAULT_SESSION_IDLE))
        prefix = settings.pop("prefix", DEFAULT_PREFIX)
        fair = settings.pop("fair", False)
        channel = await open_channel(parsed.endpoints, settings)
        wire = Wire.of_channel(channel, timeout, parsed.described(), parsed.user)
        try:
            self = cls.__new__(cls)
            self._setup(wire, prefix, fair, idle)
            await wire.authenticate()
            await wire.range(rpc.RangeRequest(key=self._layout.prefix, limit=1, count_only=True))
        except BaseException:
            await shielded(wire.aclose())
            raise
        return self

    def statistics(self) -> EtcdStatistics:
        """A frozen snapshot of the sessions and their counters."""
        s = self._sessions.stats()
        return EtcdStatistics(
            tuple(self._sessions.lease_ids()),
            len(self._sessions.entries),
            s.granted,
            s.lost,
            s.keepalives,
            s.keepalive_failures,
            s.expired_entries,
            self._handoffs.count,
            self._wire.watch_streams,
            self._wire.delete_batches,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")

    def _remember(self, name: str, holder: HolderInfo | None, revision: int, key: bytes) -> None:
        """Note that ``holder`` (its key ``key``) held ``name`` at ``revision`` (for
        :meth:`wait_changed`)."""
        self._remember_identity(name, state_of(holder), int(revision), key)

    def _remember_identity(self, name: str, identity: object, revision: int, key: bytes) -> None:
        self._seen.pop(name, None)
        if len(self._seen) >= SEEN_LIMIT:
            del self._seen[next(iter(self._seen))]
        self._seen[name] = (identity, revision, key)

    # -- slots: which key an attempt writes (see :mod:`._keys`) -----------------------------

    def _known_slot(self, name: str, owner: str) -> str | None:
        """:meth:`Slots.known` of ``owner``'s attempt at ``name``."""
        return self._slots.known(name, owner, self._sessions.entries.get((name, owner)))

    def _take_slot(self, name: str, owner: str) -> str:
        """:meth:`Slots.take` for an attempt of ``owner``."""
        return self._slots.take(name, owner, self._sessions.entries.get((name, owner)))

    async def _find(self, name: str, owner: str, token: int | None) -> Any:
        """``owner``'s key of ``name`` (grant ``token``, if given) as the server has it, or
        ``None``: for a grant made through another backend object, whose slot is unknown.
        A permit request's (a permit's owner id): its permit key or its queue key."""
        every = self._layout.permits if is_permit_owner(owner) else self._layout.every
        reply = await self._wire.range(every(name))
        for kv in reply.kvs:
            if self._layout.owner(name, kv) == owner and (
                token is None or int(kv.create_revision) == token
            ):
                return kv
        return None

    def _grant(self, token: int, ttl: float, session: Session) -> Grant:
        return Grant(token, session.grant_ttl(ttl), session.effective_sent(ttl))

    # -- the contract -----------------------------------------------------------------

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        self._check_open()
        touched = now()
        handed = self._handoffs.take(name, owner)
        if handed is not None:
            grant = self._take_handed(name, owner, ttl, handed, touched)
            if grant is not None:
                return grant
        value = encode_value(identity, metadata)
        for _ in range(2):
            session = await self._sessions.enter(ttl)  # the hot path: no context manager
            try:
                result = await self._guarded(
                    name, owner, self._acquire(name, owner, ttl, value, session, touched)
                )
            except SessionGone:
                self._sessions.lose(session)
                continue
            finally:
                self._sessions.leave(session)
            if result is not None:
                return result
        raise BackendUnavailable(f"etcd: no session lease lasted long enough to grant {name!r}")

    async def _acquire(
        self, name: str, owner: str, ttl: float, value: bytes, session: Session, touched: float
    ) -> Grant | HolderInfo | None:
        """One attempt; ``None`` when the key vanished under it (try again)."""
        slot = self._take_slot(name, owner)
        if slot != owner:
            value = with_owner(value, owner)
        request = self._layout.acquire(name, slot, value, session.lease_id, self._fair)
        reply = await self._wire.txn(request)
        self._check_open()
        if reply.succeeded:
            token = int(reply.header.revision)
            metadata = decode_value(value)[1]
            state = (owner, token, tuple(sorted(metadata.items())))
            self._remember_identity(name, state, token, self._layout.key(name, slot))
            self._values.pop((name, owner), None)
            entry = Entry(name, owner, token, session, touched + ttl, slot=slot)
            self._sessions.attach(entry)
            self._takeovers.watch(entry)
            return self._grant(token, ttl, session)
        kv = reply.responses[-1].response_range.kvs[0]
        holder = self._layout.holder(name, kv)
        self._remember(name, holder, reply.header.revision, bytes(kv.key))
        if holder.owner != owner:
            if not self._fair:
                self._slots.refused(name, owner, (name, owner) in self._sessions.entries)
            elif reply.responses[0].response_txn.succeeded:
                self._queued(name, owner, session, touched, reply)
            else:
                self._note_waiting(name, owner, value, touched + QUEUE_HORIZON * ttl)
            return holder
        if (name, owner, holder.token) in self._sessions.doomed:
            return holder  # expired here; its key is being deleted
        return await self._regrant(name, owner, ttl, kv, session, touched)

    def _queued(self, name: str, owner: str, session: Session, touched: float, reply: Any) -> None:
        """A refused attempt whose transaction also queued ``owner``'s key (fair mode):
        keep the key for :data:`TURN_GRACE` (the core's :meth:`wait_turn` follows at once,
        and keeps it longer), and its predecessor, so that ``wait_turn`` needs no request."""
        token = int(reply.header.revision)
        entry = Entry(name, owner, token, session, touched + TURN_GRACE, queued=True)
        self._sessions.attach(entry)
        kvs = reply.responses[0].response_txn.responses[1].response_range.kvs
        if len(self._turns) >= SEEN_LIMIT:
            del self._turns[next(iter(self._turns))]
        self._turns[(name, owner)] = (kvs[1] if len(kvs) > 1 else None, token)

    def _note_waiting(self, name: str, owner: str, value: bytes, horizon: float) -> None:
        """A refused attempt: keep its value for the queue, and its queued key alive."""
        if not self._fair:
            return
        if len(self._values) >= SEEN_LIMIT and (name, owner) not in self._values:
            del self._values[next(iter(self._values))]
        self._values[(name, owner)] = value
        entry = self._sessions.entries.get((name, owner))
        if entry is not None and entry.queued:
            entry.horizon = max(entry.horizon, horizon)

    async def _regrant(
        self, name: str, owner: str, ttl: float, kv: Any, session: Session, touched: float
    ) -> Grant | None:
        """``owner``'s key is first: a retry of a grant, or a queued attempt whose turn came."""
        token = int(kv.create_revision)
        slot = self._layout.slot(name, kv)
        if int(kv.lease) != session.lease_id:
            moved = await self._wire.txn(self._layout.move(name, slot, token, session.lease_id))
            if not moved.succeeded:
                return None
        entry = self._sessions.entries.get((name, owner))
        if entry is None or entry.token != token:
            entry = Entry(name, owner, token, session, touched + ttl, slot=slot)
            self._sessions.attach(entry)
        elif entry.session is not session:
            self._sessions.move(entry, session)
        return self._granted(entry, ttl, touched)

    def _take_handed(
        self, name: str, owner: str, ttl: float, token: int, touched: float
    ) -> Grant | None:
        """The grant a release here handed to ``owner``'s queued key (see :mod:`._handoff`),
        if its key is still on a usable session; else ``None`` (ask the server)."""
        entry = self._sessions.entries.get((name, owner))
        if entry is None or entry.token != token or not entry.queued or entry.reason is not None:
            return None
        if not entry.session.usable(touched):
            return None  # the server decides, and moves the key to a fresh session
        return self._granted(entry, ttl, touched)

    def _granted(self, entry: Entry, ttl: float, touched: float) -> Grant:
        """``entry``'s key, on its session, is the first: it holds the name now."""
        entry.queued = False
        _touch(entry, touched + ttl)
        entry.session.poke_at(entry.horizon)
        self._values.pop((entry.name, entry.owner), None)
        self._takeovers.watch(entry)
        return self._grant(entry.token, ttl, entry.session)

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        self._check_open()
        touched = now()
        entry = self._sessions.entries.get((name, owner))
        if entry is None or entry.session.ttl != ttl:
            return await self._adopt(name, owner, token, ttl, entry, touched)
        if entry.token != token or entry.queued or entry.horizon <= touched:
            raise NotOwnerError(name)
        session = entry.session
        error = session.error
        if error is not None:
            _touch(entry, touched + ttl)
            raise type(error)(f"the keepalive of the session lease is failing: {error}")
        _touch(entry, touched + ttl)
        return self._grant(token, ttl, session)

    async def _adopt(
        self, name: str, owner: str, token: int, ttl: float, entry: Entry | None, touched: float
    ) -> Grant:
        """Renew with another ttl (or through another backend object): move the key onto
        the session for ``ttl``. One round trip.

        :raises NotOwnerError: the key is gone, or is not grant ``token``
        """
        if entry is not None and (entry.token != token or entry.queued):
            raise NotOwnerError(name)
        if (name, owner, token) in self._sessions.doomed:
            raise NotOwnerError(name)
        for _ in range(2):
            async with self._sessions.using(ttl) as session:
                try:
                    return await self._guarded(
                        name, owner, self._move(name, owner, token, ttl, entry, session, touched)
                    )
                except SessionGone:
                    self._sessions.lose(session)
        raise BackendUnavailable(f"etcd: no session lease lasted long enough to renew {name!r}")

    async def _move(
        self,
        name: str,
        owner: str,
        token: int,
        ttl: float,
        entry: Entry | None,
        session: Session,
        touched: float,
    ) -> Grant:
        slot = self._known_slot(name, owner)
        reply = None
        if slot:
            reply = await self._wire.txn(self._layout.move(name, slot, token, session.lease_id))
        elif (kv := await self._find(name, owner, token)) is not None:
            # A grant made through another backend object, whose slot is not known here.
            slot = self._layout.slot(name, kv)
            reply = await self._wire.txn(self._layout.move(name, slot, token, session.lease_id))
        if reply is None or not reply.succeeded or not slot:
            if entry is not None:
                self._sessions.end(entry, LossReason.STOLEN)
            raise NotOwnerError(name)
        if entry is None:
            entry = Entry(name, owner, token, session, touched + ttl, slot=slot)
            self._sessions.attach(entry)
        else:
            self._sessions.move(entry, session)
            _touch(entry, touched + ttl)
            session.poke_at(entry.horizon)
        self._takeovers.watch(entry)
        return self._grant(token, ttl, session)

    def hold(
        self, name: str, owner: str, token: int, ended: Callable[[LossReason], object]
    ) -> Session:
        """The core holds ``owner``'s grant: keep its key for as long as the session
        lives (no renewals, no horizon), until released; ``ended(reason)`` when lost.

        :raises NotOwnerError: the grant is not (any more) held through this backend
        """
        entry = self._sessions.entries.get((name, owner))
        if entry is None or entry.token != token or entry.queued or entry.reason is not None:
            raise NotOwnerError(name)
        entry.horizon = math.inf
        entry.callbacks.append(ended)
        return entry.session

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        if self._closed:
            return False  # closing revoked the sessions, and every key with them
        entry = self._sessions.entries.get((name, owner))
        if entry is not None and entry.queued and is_permit_owner(owner):
            token = None  # a queued permit request leaves the queue whatever token is given
        if entry is not None and entry.horizon == math.inf:
            # Held until now: should the delete fail, the key still lapses after its ttl.
            entry.horizon = now() + entry.session.ttl
            entry.session.poke_at(entry.horizon)
        doomed = token is not None and (name, owner, token) in self._sessions.doomed
        if entry is not None and (token is None or entry.token == token):
            self._takeovers.unwatch(entry)  # its delete is ours
        self._turns.pop((name, owner), None)
        self._handoffs.forget(name, owner)
        permit = is_permit_owner(owner)
        if permit:
            self._forget_queued(name, owner)
            if self._permit_handed:
                self._permit_handed.pop((name, owner), None)
            if self._permit_ready:
                self._permit_ready.pop((name, owner), None)
        slot = self._known_slot(name, owner)
        try:
            if (
                permit
                and slot
                and entry is not None
                and not entry.queued
                and token is not None
                and entry.token == token
                and not doomed
                and entry.reason is None
                and self._permit_queued
                and await self._hand_permit(entry)
            ):
                deleted, gone = True, True  # its key deleted, its place handed on
            elif permit and token is None and slot:
                # A request given up: its queue key, or the permit key a release here
                # may have handed it (see _hand_permit), whichever exists.
                reply = await self._wire.txn(self._layout.permit_give_up(name, slot))
                deleted = reply.responses[1].response_delete_range.deleted > 0
                gone = True
            elif slot and (token is None or (entry is not None and entry.token == token)):
                # The key in the slot can only be this grant: only owner's attempts write
                # there, and the entry is the latest of them. No compare needed.
                reply = await self._wire.delete(self._layout.delete_key(name, slot))
                deleted, gone = reply.deleted > 0, True
            elif slot:
                reply = await self._wire.txn(self._layout.delete(name, slot, token))
                deleted = reply.succeeded and reply.responses[0].response_delete_range.deleted > 0
                gone = bool(reply.succeeded)  # the delete ran: the key is gone
            else:
                deleted, gone = await self._release_unknown(name, owner, token), False
        except BaseException:
            # The delete may still arrive, later than anything sent after it: the
            # slot must never hold another attempt's key.
            self._slots.unsure(name, owner)
            raise
        self._values.pop((name, owner), None)
        reuse = False
        if self._slots.settle(name, owner):
            late = self._delete_late(name, owner, slot or None)
            self._sessions.spawn(late, f"etcd late delete {name!r}")
        else:
            reuse = gone and (permit or not self._fair)
        queued = False
        if entry is not None and (token is None or entry.token == token):
            queued = entry.queued
            if deleted and not queued and not doomed and entry.reason is None and not permit:
                self._handoffs.released(entry)  # before its end wakes the successor
            self._sessions.end(entry, LossReason.RELEASED)
        if reuse and slot and (name, owner) not in self._sessions.entries:
            # Deleted, and no request of the attempt can still arrive: reuse its key.
            self._slots.released(name, owner, slot)
        return bool(deleted) and not queued and not doomed

    async def _guarded(self, name: str, owner: str, attempt: Coroutine[Any, Any, T]) -> T:
        """Run an ``attempt`` that may write ``owner``'s key to its end, and record it.

        A cancelled request may still be applied by etcd *after* a later one (such as
        the core's compensating release), so the attempt is not cancelled: the caller's
        cancellation waits for its reply (up to :data:`CANCEL_GRACE`). When the reply is
        lost anyway (a timeout, a broken connection, that grace), the release of ``owner``
        deletes the key once more, later. The attempt runs in the caller's task: its only
        waits are unary calls (:func:`finishing`).
        """
        try:
            return await finishing(attempt, CANCEL_GRACE)
        except (SessionGone, ForeignDataError, LimitMismatchError):
            raise  # the lease is gone (nothing written), or the reply came: nothing in doubt
        except BaseException:
            self._slots.unsure(name, owner)
            raise

    async def _release_unknown(self, name: str, owner: str, token: int | None) -> bool:
        """Release a grant whose slot this backend does not know (made through another
        backend object, or refused here): by fenced deletes only, as a slot that is not
        ``owner``'s may be another owner's now."""
        if token is not None:
            reply = await self._wire.txn(self._layout.delete(name, owner, token))
            if reply.succeeded and reply.responses[0].response_delete_range.deleted > 0:
                return True
        kv = await self._find(name, owner, token)
        if kv is None:
            return False
        request = self._layout.delete(name, self._layout.slot(name, kv), int(kv.create_revision))
        reply = await self._wire.txn(request)
        return bool(reply.succeeded and reply.responses[0].response_delete_range.deleted > 0)

    async def _delete_late(self, name: str, owner: str, slot: str | None) -> None:
        """Delete ``owner``'s key of ``name`` (in ``slot``, if known) once a request of it
        that was never answered can no longer arrive (unless ``owner`` holds it again
        through this backend). A slot with such a request is never reused."""
        await asyncio.sleep(LATE_AFTER * self._wire.timeout)
        if (name, owner) not in self._sessions.entries:
            try:
                if slot and is_permit_owner(owner):
                    await self._wire.txn(self._layout.permit_give_up(name, slot))  # (both keys)
                elif slot:
                    await self._wire.txn(self._layout.delete(name, slot, None))
                else:
                    await self._release_unknown(name, owner, None)
            except BackendError as exc:
                logger.info("late delete of %r failed (its session lease ends it): %r", name, exc)

    def _taken(self, entry: Entry) -> None:
        """The key of a held ``entry`` was deleted on the server: it is lost."""
        logger.info("etcd key of lease %r (token %d) was deleted", entry.name, entry.token)
        self._sessions.end(entry, LossReason.STOLEN)

    async def _delete_expired(self, name: str, slot: str, token: int) -> None:
        """Delete the key of a grant nobody renewed (the sessions' horizon)."""
        await self._wire.txn(self._layout.delete(name, slot, token))

    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        """Write ``owner``'s key of ``name`` anew with ``metadata`` (etcd's Proclaim: a
        txn that requires the key to be grant ``token`` and the first; it keeps the
        key's create revision, so the token, and its session lease). Watchers of the
        key see a new value; the holder's takeover watch waits for a deletion only."""
        self._check_open()
        kv = await self._find(name, owner, token)
        if kv is None:
            raise NotOwnerError(name)
        holder = self._layout.holder(name, kv)
        slot = self._layout.slot(name, kv)
        value = encode_value(holder.identity, metadata, None if slot == owner else owner)
        reply = await self._wire.txn(self._layout.update(name, slot, token, value))
        if not reply.succeeded:
            raise NotOwnerError(name)

    async def read(self, name: str) -> HolderInfo | None:
        self._check_open()
        reply = await self._wire.range(self._layout.first(name))
        holder = self._layout.holder(name, reply.kvs[0]) if reply.kvs else None
        key = bytes(reply.kvs[0].key) if reply.kvs else b""
        self._remember(name, holder, reply.header.revision, key)
        return holder

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        """Watch from the revision at which ``seen`` was last read: for the holder's
        key to go or change (or, when free, for a key to appear). One round trip when ``seen``
        came from this backend's latest read of ``name``, two otherwise."""
        self._check_open()
        expected = state_of(seen)
        known = self._seen.get(name)
        if known is None or known[0] != expected:
            if state_of(await self.read(name)) != expected:
                return
            known = self._seen[name]
        if seen is None:
            await self._wire.watch(self._layout.watch_create(name, known[1]), _any_event)
        else:
            # Its deletion, or a new value: the holder's new metadata (update_metadata).
            key = known[2] or self._layout.key(name, seen.owner)
            await self._wire.watch(self._layout.watch_key(key, known[1]), _any_event)

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Fair mode: queue ``owner``'s key, then watch only its predecessor's."""
        if not self._fair:
            await self.wait_changed(name, seen)
            return
        self._check_open()
        touched = now()
        turn = self._turns.pop((name, owner), None)
        entry = self._sessions.entries.get((name, owner))
        if turn is not None and entry is not None and entry.queued and entry.token == turn[1]:
            # Queued by the refused try_acquire just now: watch its predecessor at once.
            entry.horizon = max(entry.horizon, touched + QUEUE_HORIZON * ttl)
            if turn[0] is not None:
                await self._wait_for(name, owner, turn[0], turn[1])
            return
        for _ in range(2):
            async with self._sessions.using(ttl) as session:
                try:
                    found = await self._guarded(
                        name, owner, self._enqueue(name, owner, ttl, session, touched)
                    )
                except SessionGone:
                    self._sessions.lose(session)
                    continue
            if found is not None:
                await self._wait_for(name, owner, *found)
            return
        raise BackendUnavailable(f"etcd: no session lease lasted long enough to queue {name!r}")

    async def _wait_for(self, name: str, owner: str, predecessor: Any, revision: int) -> None:
        """Wait for the key ``predecessor`` (read at ``revision``) to go: on its entry when
        it is this backend's (see :mod:`._handoff`), else by a watch."""
        entry = self._sessions.entries.get((name, self._layout.slot(name, predecessor)))
        mine = self._sessions.entries.get((name, owner))
        if (
            entry is not None
            and entry.token == int(predecessor.create_revision)
            and mine is not None
            and mine.queued
        ):
            await self._handoffs.wait(entry, owner, mine.token)
            return
        request = self._layout.watch_delete(bytes(predecessor.key), revision)
        await self._wire.watch(request, _any_event)
        if mine is not None and mine.queued:
            # As etcd's Mutex does: a read (no write, no consensus round) tells whether a
            # key older than ours is left; if none is, ours is the first, and the next
            # try_acquire takes the name without its transaction.
            ahead = await self._wire.range(self._layout.predecessor(name, mine.token))
            if not ahead.kvs and self._sessions.entries.get((name, owner)) is mine:
                self._handoffs.hand(name, owner, mine.token)

    async def _enqueue(
        self, name: str, owner: str, ttl: float, session: Session, touched: float
    ) -> tuple[Any, int] | None:
        """Put ``owner``'s queued key unless it exists; its predecessor and the revision
        at which it was read (``None``: no predecessor, its turn has come)."""
        value = self._values.get((name, owner)) or encode_value("", {})
        request = self._layout.enqueue(name, owner, value, session.lease_id)
        reply = await self._wire.txn(request)
        horizon = touched + QUEUE_HORIZON * ttl
        if reply.succeeded:
            token = int(reply.header.revision)
            self._sessions.attach(Entry(name, owner, token, session, horizon, queued=True))
            kvs = reply.responses[1].response_range.kvs
            return (kvs[1], token) if len(kvs) > 1 else None
        mine = reply.responses[0].response_range.kvs[0]
        token = int(mine.create_revision)
        entry = self._sessions.entries.get((name, owner))
        if entry is None or entry.token != token:
            self._sessions.attach(Entry(name, owner, token, session, horizon, queued=True))
        elif entry.queued:
            entry.horizon = max(entry.horizon, horizon)
        ahead = await self._wire.range(self._layout.predecessor(name, token))
        return (ahead.kvs[0], int(ahead.header.revision)) if ahead.kvs else None

    # -- permits (docs/internals/semaphores.md; see :mod:`._permit_values`) -------------

    async def wait_lost(self, name: str, owner: str, token: int) -> LossReason:
        """Return when ``owner``'s grant of ``name`` ended here: its session was lost,
        it expired unrenewed, or the backend closed (``SHUTDOWN``)."""
        entry = self._sessions.entries.get((name, owner))
        if entry is None or entry.token != token:
            return LossReason.STOLEN
        return await entry.wait_ended()

    async def aclose(self) -> None:
        """Revoke the session leases (their keys go with them) and close what the backend
        opened. Leases still held through it end with ``SHUTDOWN`` first."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._sessions.aclose()
        finally:
            await shielded(self._wire.aclose())
