"""MongoBackend: the contract of :mod:`aiolease.abc` on MongoDB (see the package)."""

from __future__ import annotations

import asyncio
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..._exceptions import (
    BackendTimeout,
    BackendUnavailable,
    InvalidArgument,
    LossReason,
    NotOwnerError,
)
from ..._permits import PermitHolders, is_permit_owner
from ..._records import state_of
from ..._urls import redact, scrub
from ..._validate import check_seconds
from ...abc import Backend, Capability, Grant, HolderInfo, Renewal, RenewResult
from .._asyncio import now, wait_event
from .._takers import Takers, no_watch
from ..sql._permits import by_kind
from ..sql._running import finished
from ..sql._values import check_owner
from ..sql._wakeups import Wakeups
from . import _pipelines as pipelines
from ._commands import whole as _whole
from ._docs import LEFT, check, holder_of
from ._errors import mapped
from ._permit_ops import MongoPermits
from ._stream import Notice, Stream
from ._turns import Turns
from ._url import (
    DEFAULT_COLLECTION,
    DEFAULT_DATABASE,
    check_collection,
    check_database,
    check_w,
    parse_url,
)
from ._writes import Writer

__all__ = ["MongoBackend", "MongoStatistics"]

#: How many times an acquire that lost a race of first upserts asks again.
_RACE_RETRIES = 8
#: A fair waiter asks again (refreshing its queue entry, which lasts its ttl) this
#: share of its ttl after its latest refusal, so that it keeps its place.
_REFRESH_SHARE = 1 / 3
#: A hand-off is taken without a command only if the refused ask it follows was sent
#: less than this share of the ttl ago (else the waiter asks again, for a full ttl).
_FRESH_SHARE = 0.5
#: The longest a waiter waits on a push wake-up before it reads again (a safety net
#: for an event the stream missed without failing).
_PUSH_CHECK = 10.0
#: The most waiters remembered as refused (forgotten by their grant or release).
_MAX_REFUSED = 4096
#: What a client made from a URL gets unless the URL says otherwise: a server that
#: cannot be reached is reported in 10 s, not pymongo's 30 s.
_CLIENT_DEFAULTS: dict[str, Any] = {
    "serverSelectionTimeoutMS": 10_000,
    "connectTimeoutMS": 10_000,
    "appname": "aiolease",
}
#: Server topologies with change streams.
_STREAMING = ("replica set", "sharded cluster")


@dataclass(frozen=True, slots=True)
class MongoStatistics:
    """What one :class:`MongoBackend` did so far.

    :param topology: ``replica set``, ``sharded cluster``, ``standalone`` or ``unknown``
        (not probed yet: a client you passed in, before :meth:`MongoBackend.probe`)
    :param streaming: whether the change stream is open now
    :param stream_opens: how many times it was opened
    :param acquire_commands: acquire commands sent (each one ``findAndModify``)
    :param renew_commands: renewal commands sent (each one ``bulk_write`` for a tick)
    :param waiting: tasks blocked in ``wait_changed`` or ``wait_turn`` now
    :param handoffs_taken: hand-offs taken from a change event, without a command
    """

    topology: str
    streaming: bool
    stream_opens: int
    acquire_commands: int
    renew_commands: int
    waiting: int
    handoffs_taken: int = 0


def _client_kind(client: object) -> str:
    """``pymongo`` or ``motor``.

    :raises InvalidArgument: ``client`` is neither an ``AsyncMongoClient`` nor motor's
    """
    from pymongo import AsyncMongoClient

    if isinstance(client, AsyncMongoClient):
        return "pymongo"
    if type(client).__module__.startswith("motor") and hasattr(client, "get_database"):
        return "motor"
    raise InvalidArgument(
        "client must be a pymongo.AsyncMongoClient (or motor's AsyncIOMotorClient),"
        f" not {type(client).__name__}"
    )


class MongoBackend(Backend):
    """Leases as documents of a MongoDB collection, on pymongo's asyncio client.

    :param client: a ``pymongo.AsyncMongoClient`` or a motor ``AsyncIOMotorClient``
        (yours: never closed by the backend)
    :param database: the database of the lease collection
    :param collection: the lease collection (created by the first grant)
    :param fair: serve waiters first come, first served (a queue in each lease document)
    :param watch: wake waiters from one change stream (replica sets, sharded clusters)
    :param poll_interval: how often a waiter looks again while no stream is open
    :param w: the write concern's ``w`` (default ``"majority"``; see the docs for what
        ``1`` gives up)
    :param wtimeout: seconds before a write concern wait is an unknown outcome
        (:class:`BackendTimeout`; default: none, the core bounds its own calls)
    :param topology: what the server is, if you know it (``"replica set"``,
        ``"sharded cluster"`` or ``"standalone"``), so that :attr:`capabilities` say
        it before :meth:`probe` asks the server (which it then overrides)
    :raises InvalidArgument: a bad name, number or client
    """

    requires_asyncio = True

    def __init__(
        self,
        client: Any,
        *,
        database: str = DEFAULT_DATABASE,
        collection: str = DEFAULT_COLLECTION,
        fair: bool = True,
        watch: bool = True,
        poll_interval: float = 0.5,
        w: int | str = "majority",
        wtimeout: float | None = None,
        topology: str | None = None,
    ) -> None:
        from pymongo import ReadPreference
        from pymongo.read_concern import ReadConcern
        from pymongo.write_concern import WriteConcern

        self._kind = _client_kind(client)
        self._database = check_database(database)
        self._collection = check_collection(collection)
        self._fair = bool(fair)
        self._watches = bool(watch)
        self.poll_interval = check_seconds("poll_interval", poll_interval)
        self._w = check_w(w)
        timeout_ms = (
            None if wtimeout is None else max(1, round(check_seconds("wtimeout", wtimeout) * 1000))
        )
        self._client = client
        self._owned = False
        self._url: str | None = None
        self._where = f"{self._database}.{self._collection}"
        database_ = client.get_database(self._database)
        self._coll = database_.get_collection(
            self._collection,
            write_concern=WriteConcern(w=self._w, wtimeout=timeout_ms),
            read_concern=ReadConcern("majority"),
            read_preference=ReadPreference.PRIMARY,
        )
        if topology is not None and topology not in (*_STREAMING, "standalone"):
            raise InvalidArgument(
                "topology must be 'replica set', 'sharded cluster' or 'standalone',"
                f" got {topology!r}"
            )
        self._topology = topology or "unknown"
        #: The grants, releases and metadata updates (see ``_writes``).
        self._writer = Writer(database_, self._collection, self._w, timeout_ms)
        #: This object's id in ``by`` (see :data:`~aiolease.backends.mongo._pipelines.BY`).
        self._id = uuid.uuid4().hex[:16]
        self._writes = 0
        self._stream = Stream(
            self._coll,
            self._notice,
            self._stream_lost,
            retry_after=self.poll_interval,
            own=self._id,
        )
        self._wakeups = Wakeups()
        self._turns = Turns()
        self._takers = Takers()
        #: (name, owner) -> (send time of its latest refused ask, the token it saw).
        self._refused: dict[tuple[str, str], tuple[float, int]] = {}
        #: Names last seen released with nobody to hand them to (see ``_seen_free``).
        self._free: dict[str, bool] = {}
        self._acquire_commands = 0
        self._handoffs_taken = 0
        self._renew_commands = 0
        self._waiting = 0
        self._closed = False
        self._permits = MongoPermits(
            database_.get_collection(
                f"{self._collection}_permits",
                write_concern=WriteConcern(w=self._w, wtimeout=timeout_ms),
                read_concern=ReadConcern("majority"),
                read_preference=ReadPreference.PRIMARY,
            ),
            f"{self._where}_permits",
            Writer(database_, f"{self._collection}_permits", self._w, timeout_ms),
            mapped=lambda: mapped(self._url),
            stamp=self._stamp,
            own=self._id,
            poll_interval=self.poll_interval,
            watch=self._watches,
        )

    def __repr__(self) -> str:
        where = redact(self._url) if self._url is not None else f"<{self._kind} client>"
        mode = ", fair" if self._fair else ""
        return f"<MongoBackend {where} {self._where}{mode}>"

    @property
    def capabilities(self) -> frozenset[Capability]:
        """Server time and multi-process always; durable tokens with majority writes;
        the fair queue when ``fair``; push wake-ups once a probe found change streams;
        metadata updates in place always."""
        caps = {
            Capability.SERVER_TIME,
            Capability.MULTI_PROCESS,
            Capability.PROCLAIM,
            Capability.SEMAPHORE,
            Capability.FAIR_PERMITS,
            Capability.PERMIT_RETRY_KEEPS_ENTRY,
        }
        if self._w == "majority":
            caps.add(Capability.DURABLE_TOKENS)
        if self._fair:
            caps.add(Capability.FAIR_QUEUE)
        if self._watches and self._topology in _STREAMING and self._stream.available:
            caps.add(Capability.PUSH_WAKEUP)
        return frozenset(caps)

    def statistics(self) -> MongoStatistics:
        return MongoStatistics(
            self._topology,
            self._stream.up,
            self._stream.opens,
            self._acquire_commands + self._permits.commands,
            self._renew_commands,
            self._waiting + self._permits.waiting,
            self._handoffs_taken,
        )

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> MongoBackend:
        """Connect to the server ``url`` names (``mongodb://`` or ``mongodb+srv://``),
        check that it answers, and learn whether it has change streams.

        :raises InvalidArgument: a malformed URL or option
        :raises BackendUnavailable: the server cannot be reached
        """
        from pymongo import AsyncMongoClient
        from pymongo.errors import ConfigurationError, InvalidURI

        parsed = parse_url(url, options)
        ours = dict(parsed.options)
        collection = ours.pop("collection", DEFAULT_COLLECTION)
        # pymongo's keyword arguments override the URL's options: only what it lacks.
        given = {key.lower() for key in parse_qs(urlsplit(parsed.client_url).query)}
        defaults = {k: v for k, v in _CLIENT_DEFAULTS.items() if k.lower() not in given}
        try:
            with warnings.catch_warnings():
                # pymongo warns of an unknown option, and goes on: an error here.
                warnings.simplefilter("error", UserWarning)
                client: Any = AsyncMongoClient(parsed.client_url, **defaults)
        except (ConfigurationError, InvalidURI, UserWarning, ValueError, TypeError) as exc:
            raise InvalidArgument(scrub(f"MongoDB URL {redact(url)!r}: {exc}", url)) from None
        try:
            backend = cls(client, database=parsed.database, collection=collection, **ours)
            backend._owned = True
            backend._url = url
            await backend.probe()
        except BaseException:
            await client.close()
            raise
        return backend

    async def probe(self) -> str:
        """Ask the server what it is (one ``hello``), so that :attr:`capabilities` say
        whether waiters are woken by a change stream; open the stream if so.

        :returns: the topology (``replica set``, ``sharded cluster`` or ``standalone``)
        :raises BackendUnavailable: the server cannot be reached
        """
        with mapped(self._url):
            hello = await self._client.get_database("admin").command("hello")
        if hello.get("msg") == "isdbgrid":
            self._topology = "sharded cluster"
        elif hello.get("setName"):
            self._topology = "replica set"
        else:
            self._topology = "standalone"
            self._stream.available = False
            self._permits.no_streams()
        if self._watches and self._stream.available:
            await self._stream.ensure()
        return self._topology

    # -- running commands ------------------------------------------------------------------

    def _stamp(self) -> str:
        """What this backend's next grant or release writes to ``by`` (see ``BY``)."""
        self._writes += 1
        return f"{self._id}:{self._writes}"

    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")

    async def _find_and_modify(
        self,
        filter_: Mapping[str, Any],
        update: Any,
        *,
        upsert: bool,
        after: bool,
        projection: Mapping[str, Any] = pipelines.REPLY,
    ) -> Any:
        return await self._writer.find_and_modify(
            filter_, update, fields=projection, upsert=upsert, new=after
        )

    async def _grant(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Any:
        """The grant command; ``None`` when it lost a race of first upserts (ask again)."""
        from pymongo.errors import DuplicateKeyError

        self._acquire_commands += 1
        stamp = self._stamp()
        with mapped(self._url):
            if self._free.pop(name, False):
                try:
                    return await self._find_and_modify(
                        pipelines.free_filter(name, self._fair),
                        pipelines.take_free(owner, ttl, identity, metadata, stamp),
                        upsert=True,
                        after=True,
                        projection=pipelines.TAKEN,
                    )
                except DuplicateKeyError:
                    self._acquire_commands += 1  # not free any more: the full command
            update = pipelines.grant(owner, ttl, identity, metadata, self._fair, stamp)
            try:
                return await self._find_and_modify({"_id": name}, update, upsert=True, after=True)
            except DuplicateKeyError:
                return None  # another first upsert won: the next ask sees its holder

    def _seen_free(self, name: str) -> None:
        """``name`` was released with nobody to hand it to: its next grant here tries
        the short command first (see :func:`~._pipelines.free_filter`)."""
        if len(self._free) >= _MAX_REFUSED:
            self._free.clear()
        self._free[name] = True

    # -- the contract ------------------------------------------------------------------------

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        self._check_open()
        check_owner(owner)
        handed = self._handed(name, owner, float(ttl))
        if handed is not None:
            await asyncio.sleep(0)  # a checkpoint; a cancel here leaves it to the caller's release
            return handed
        for _ in range(_RACE_RETRIES):
            sent_at = now()
            # Seen to its end even if the caller is cancelled (see ``finished``).
            doc = await finished(self._grant(name, owner, float(ttl), identity, metadata))
            if doc is None:
                continue
            if doc.get("owner") == owner:  # granted (so the document was found valid)
                token = int(doc["token"])
                self._refused.pop((name, owner), None)
                self._turns.forget(name, owner)
                self._wakeups.wake(name)
                # The stream leaves out this backend's own writes: a holder here whose
                # grant this one took over learns it now.
                self._takers.notified(name, owner, token)
                return Grant(token, float(ttl))
            check(self._where, name, doc)
            holder = holder_of(self._where, name, doc) or self._queued_before(name, doc, owner)
            if holder is None:
                continue  # pragma: no cover - neither granted nor refused: ask again
            if self._fair:
                if len(self._refused) >= _MAX_REFUSED:
                    self._refused.clear()  # waiters that never came back (a safety net)
                self._refused[(name, owner)] = (sent_at, holder.token)
            return holder
        raise BackendTimeout(f"lease {name!r} kept changing under try_acquire; try again")

    def _handed(self, name: str, owner: str, ttl: float) -> Grant | None:
        """A hand-off to ``owner`` seen while it waited, taken without a command.

        The release that handed it over ran after every refused ask of ``owner`` (an
        ask after it would have found the lease ``owner``'s, and been granted), and
        gave it ``ttl`` from its own ``$$NOW``: so it lasts at least ``ttl`` from the
        send time of ``owner``'s latest refused ask, which is the grant's ``sent_at``
        (if that is recent enough; else ``owner`` asks again, for a full ttl). Only a
        token newer than the one that refusal saw is taken: the hand-off then came
        after it (an event that was late for an earlier ask, of a grant that lapsed
        meanwhile, is not).
        """
        token = self._turns.take(name, owner)
        refused = self._refused.get((name, owner))
        if token is None or refused is None:
            return None
        refused_at, seen = refused
        # A token newer than the refusal saw: the hand-off came after that ask (an
        # event of an older grant, which lapsed since, arrives too late to count).
        if token <= seen or now() - refused_at >= ttl * _FRESH_SHARE:
            return None
        self._refused.pop((name, owner), None)
        self._turns.forget(name, owner)
        self._handoffs_taken += 1
        return Grant(token, ttl, sent_at=refused_at)

    @staticmethod
    def _queued_before(
        name: str, doc: Mapping[str, Any], owner: str, lefts: Sequence[object] | None = None
    ) -> HolderInfo | None:
        """The first live waiter of ``doc``'s queue other than ``owner`` (a free name
        refused to a caller when fair: it is served first), reported as the holder.

        :param lefts: the server's milliseconds left of each entry (``None``: the queue
            holds live entries only, as a refusal writes it; each is then reported with
            its ttl left, at most)
        """
        queue = doc.get("queue") or ()
        for i, entry in enumerate(queue):
            if not isinstance(entry, Mapping) or entry.get("owner") == owner:
                continue
            left = entry.get("ttl") if lefts is None else lefts[i] if i < len(lefts) else 0
            left = left * 1000 if lefts is None and isinstance(left, (int, float)) else left
            if isinstance(left, (int, float)) and left > 0:
                meta = entry.get("metadata")
                return HolderInfo(
                    name,
                    str(entry.get("owner")),
                    str(entry.get("identity", "")),
                    int(doc["token"]),
                    dict(meta) if isinstance(meta, Mapping) else {},
                    left / 1000.0,
                )
        return None

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        (result,) = await self.renew_many([(name, owner, token, ttl)])
        if isinstance(result, Grant):
            return result
        raise result

    async def renew_many(self, renewals: Sequence[Renewal]) -> Sequence[RenewResult]:
        """Every renewal in one unordered ``bulk_write`` (each update owner- and
        token-checked, and judged live on the server's clock); only when some did not
        match, one ``find`` tells which are still held (renewed by it) and which not."""
        from pymongo import UpdateOne

        self._check_open()
        if not renewals:
            return []
        locks, held_permits = by_kind(renewals)
        if held_permits:
            self._renew_commands += 1  # the permits' own bulk_write
            renewed = dict(zip(held_permits, await self._permits.renew(held_permits), strict=True))
            done = dict(zip(locks, await self.renew_many(locks), strict=True)) if locks else {}
            return [renewed[r] if r in renewed else done[r] for r in renewals]
        ops = [
            UpdateOne(pipelines.live_filter(name, owner, token), pipelines.renew(ttl))
            for name, owner, token, ttl in renewals
        ]
        sent_at = now()
        self._renew_commands += 1
        with mapped(self._url):
            result = await _whole(self._coll.bulk_write(ops, ordered=False))
        if result.matched_count == len(ops):
            return [Grant(token, float(ttl), sent_at=sent_at) for _, _, token, ttl in renewals]
        with mapped(self._url):
            docs = await _whole(
                self._coll.find(
                    {"_id": {"$in": list({r[0] for r in renewals})}}, pipelines.REPLY
                ).to_list(None)
            )
        found = {doc["_id"]: doc for doc in docs}
        results: list[RenewResult] = []
        for name, owner, token, ttl in renewals:
            doc = found.get(name)
            live = doc is not None and isinstance(doc.get(LEFT), (int, float)) and doc[LEFT] > 0
            if live and doc is not None and (doc.get("owner"), doc.get("token")) == (owner, token):
                results.append(Grant(token, float(ttl), sent_at=sent_at))
            else:
                results.append(NotOwnerError(name))
        return results

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        """Free ``owner``'s grant of ``name``, keeping the document and its token (when
        fair, hand it to the oldest live waiter), and drop ``owner``'s queue entry."""
        self._check_open()
        if is_permit_owner(owner):
            return await self._permits.release(name, owner, token)
        self._refused.pop((name, owner), None)
        self._turns.forget(name, owner)
        if await self._release_alone(name, owner, token):
            self._seen_free(name)
            self._wakeups.wake(name)
            if token is not None:  # a holder here whose grant was released in its name
                self._takers.notified(name, None, token)
            self._turns.wake(name)  # nobody was queued for it (else it was not freed here)
            return True
        if not self._fair:
            return False
        # A queue (or a refused acquire's entry of ``owner``): the full release, which
        # hands the lease to the oldest live waiter, and drops ``owner``'s own entry.
        with mapped(self._url):
            before = await _whole(
                self._find_and_modify(
                    pipelines.release_filter(name, owner, self._fair),
                    pipelines.release(owner, token, self._fair, self._stamp()),
                    upsert=False,
                    after=False,
                    projection=pipelines.RELEASE_REPLY,
                )
            )
        if before is None:
            return False
        left = before.get(LEFT)
        freed = (
            before.get("owner") == owner
            and isinstance(left, (int, float))
            and left > 0
            and (token is None or before.get("token") == token)
        )
        if freed:
            self._wakeups.wake(name)
            self._takers.notified(name, None, int(before["token"]))
            # A waiter here learns of the hand-off before the change event.
            head = self._queued_before(name, before, owner, before.get("_qleft") or ())
            if head is None:
                self._seen_free(name)
                self._turns.wake(name)
            else:
                self._turns.granted(name, head.owner, int(before["token"]) + 1, None)
        return bool(freed)

    async def _release_alone(self, name: str, owner: str, token: int | None) -> bool:
        """The release of a live grant of ``owner`` (``token``) that nobody queued for:
        one owner-checked ``update`` command (when fair, only of a document with no queue).
        Whether it freed it."""
        with mapped(self._url):
            matched = await _whole(
                self._writer.update_one(
                    pipelines.release_alone_filter(name, owner, token, self._fair),
                    pipelines.release_alone(token, self._stamp()),
                )
            )
        return bool(matched)

    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        """Replace the metadata of ``owner``'s live grant ``token`` (one update, judged
        live on the server's clock); its change event wakes every backend's watchers."""
        self._check_open()
        with mapped(self._url):
            matched = await _whole(
                self._writer.update_one(
                    pipelines.live_filter(name, owner, token),
                    pipelines.update_metadata(metadata, self._stamp()),
                )
            )
        if not matched:
            raise NotOwnerError(name)
        self._wakeups.wake(name)

    async def read(self, name: str) -> HolderInfo | None:
        self._check_open()
        with mapped(self._url):
            doc = await _whole(self._coll.find_one({"_id": name}, pipelines.REPLY))
        return holder_of(self._where, name, doc)

    # -- permits (docs/internals/semaphores.md; served by ``_permit_ops``) ------------------

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
        """One ``findAndModify`` upsert deciding on the server (see ``_permits``)."""
        self._check_open()
        return await self._permits.try_acquire(name, owner, ttl, identity, metadata, limit, weight)

    async def read_permits(self, name: str) -> PermitHolders | None:
        self._check_open()
        return await self._permits.read(name)

    async def wait_permit_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Return when a permit of ``name`` is released (through this object, or another
        one: the permits' change stream), when ``seen`` runs out, or after a third of
        ``ttl``; without a stream, after :attr:`poll_interval` at most."""
        await self._permits.wait_turn(name, owner, ttl, seen)

    # -- wake-ups ----------------------------------------------------------------------------

    def _notice(self, notice: Notice) -> None:
        """A change event of the stream (see :mod:`aiolease.backends.mongo._stream`)."""
        name = notice.name
        self._wakeups.wake(name)
        if notice.proclaimed:
            return  # the holder's new metadata: watchers look, nobody is taken
        if notice.owner is None:
            # Released (or deleted: then every grant is gone): every waiter asks again.
            self._seen_free(name)
            self._takers.notified(name, None, 2**63 if notice.token is None else notice.token)
            self._turns.wake(name)
            return
        self._free.pop(name, None)
        self._takers.notified(name, notice.owner, notice.token)
        until = None if notice.left is None else now() + notice.left
        self._turns.granted(name, notice.owner, notice.token, until)

    def _stream_lost(self) -> None:
        """Events may have been missed: every waiter looks again."""
        self._wakeups.wake_all()
        self._turns.wake_all()

    async def _streaming(self) -> bool:
        """Whether the change stream is open (opening it if it may be)."""
        if not self._watches:
            return False
        with mapped(self._url):
            return await self._stream.ensure()

    def on_taken(
        self, name: str, owner: str, token: int, taken: Callable[[LossReason], object]
    ) -> Callable[[], None] | None:
        """Call ``taken(STOLEN)`` when the change stream shows ``name``'s ``token``
        released by somebody else, or a newer token granted; only while it is open.
        A permit: no watch at all (nobody but its holder ends it before its expiry,
        which its renewals find), and no watch task either."""
        if is_permit_owner(owner):
            return no_watch
        if not self._stream.up or self._closed:
            return None
        return self._takers.add(name, owner, token, taken)

    async def wait_taken(self, name: str, held: HolderInfo) -> None:
        """A lock's holder: as every backend (see :meth:`on_taken`). A permit's holder:
        only when this backend closes. Permits have no takeover notice here (a lost
        permit shows at its next renewal); the default, :meth:`wait_changed`, compares
        the lock document of ``name`` with the permit and returned at once, so that the
        core's takeover watch read the permits document without a pause for as long
        as the permit was held."""
        if is_permit_owner(held.owner):
            await self._permits.closed()
            return
        await super().wait_taken(name, held)

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        """Return when ``name``'s holder differs from ``seen`` (renewals do not count).

        With a change stream: on a grant or release event, else when the holder's ttl
        runs out. Without one: when the holder's ttl runs out, or every
        :attr:`poll_interval` while the name is free.
        """
        streaming = await self._streaming()
        self._waiting += 1
        try:
            with self._wakeups.watching(name) as event:
                current = await self.read(name)
                if state_of(current) != state_of(seen):
                    return
                timeout = _PUSH_CHECK if streaming else self.poll_interval
                if current is not None and current.remaining is not None:
                    timeout = (
                        min(timeout, current.remaining) if not streaming else current.remaining
                    )
                await wait_event(event, timeout)
        finally:
            self._waiting -= 1

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Wait in ``name``'s queue until the lease is handed to ``owner``, released with
        nobody to hand to, the holder's ttl runs out, or ``owner``'s queue entry is due
        for a refresh (a third of ``ttl`` after its latest refused ask)."""
        refused = self._refused.get((name, owner))
        if not self._fair or refused is None:
            await self.wait_changed(name, seen)
            return
        streaming = await self._streaming()
        deadline = refused[0] + ttl * _REFRESH_SHARE
        if seen.remaining is not None:
            deadline = min(deadline, now() + seen.remaining)
        if not streaming:
            deadline = min(deadline, now() + self.poll_interval)
        turn = self._turns.start(name, owner)
        self._waiting += 1
        try:
            while True:
                limit = min(deadline, turn.until)
                if not await wait_event(turn.event, max(0.0, limit - now())) or turn.woken:
                    return
                turn.event.clear()  # re-timed by a grant to another waiter: wait on
        finally:
            self._waiting -= 1

    async def aclose(self) -> None:
        """Stop the change stream, and close the client if this backend opened it."""
        if self._closed:
            return
        self._closed = True
        self._wakeups.wake_all()
        self._turns.wake_all()
        try:
            await self._stream.aclose()
            await self._permits.aclose()
        finally:
            if self._owned:
                await self._client.close()
