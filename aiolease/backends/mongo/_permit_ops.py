"""The MongoDB backend's permits (semaphores and read-write locks,
``docs/internals/semaphores.md``): :class:`MongoPermits`, which
:class:`~aiolease.backends.mongo.MongoBackend` hands every permit operation to.

Each operation is one command on the name's permits document (see
:mod:`aiolease.backends.mongo._permits`): the acquire one ``findAndModify`` upsert
(or, of a name whose last release here left nobody in it, a short ``findAndModify``
first), the release one ``findAndModify`` that also grants the queue entries that then
fit, the renewals one unordered ``bulk_write`` per tick; the acquires and releases of a
name asked while one of its commands is in flight go together in the next
(:class:`~aiolease.backends._combine.Combiner`).
A refused request here that a release here granted takes its grant from the release's
reply without a command, and only its waiter is woken; waiters are woken by other
objects' releases through a change stream of the permits collection (opened by the
first wait, on replica sets and sharded clusters); without one they look again every
``poll_interval``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

from ..._exceptions import BackendTimeout, LimitMismatchError, NotOwnerError
from ...abc import Grant, HolderInfo, PermitHolders, Renewal, RenewResult
from .._asyncio import Tasks, now, wait_event
from .._combine import Combiner
from ..sql._permits import blocker, permit_holders
from ..sql._running import finished
from . import _permit_acquire as acquiring
from . import _permits as permits
from ._commands import whole
from ._pipelines import millis
from ._stream import Stream, freed_name, permit_watch_pipeline
from ._writes import Writer

__all__ = ["MongoPermits"]

logger = logging.getLogger("aiolease.backends.mongo")

#: A waiter asks again at most this share of its ttl after its latest refusal (its
#: queue entry lasts its ttl from the latest ask that wrote it).
_REFRESH_SHARE = 1 / 3
#: A refused ask rewrites its queue entry only when less than this share of its ttl
#: is left on it (else its place is kept without a write, which would only add
#: oplog entries and contention to the writes that matter).
_FRESH_SHARE = 0.5
#: The longest a waiter waits on a push wake-up before it asks again (a safety net
#: for an event the stream missed without failing).
_PUSH_CHECK = 10.0
#: Refused requests whose marks are remembered (one that never waits, as
#: ``acquire_nowait``'s, leaves one): the oldest half is dropped beyond it.
_MAX_MARKS = 4096

#: Where a name's wake-ups stood when a refused request was sent: (the name's count of
#: releases seen, the count of lost streams, the stream's opens if it was open, else -1).
Mark = tuple[int, int, int]
#: The most operations of one name in one command (the acquire's pipeline is 6 kB).
_MOST = 16


class _Acquire(NamedTuple):
    """The full acquire's request (:func:`~._permit_acquire.acquire`'s arguments)."""

    request: acquiring.Request

    @property
    def owner(self) -> str:
        return self.request[0]


class _Release(NamedTuple):
    owner: str
    token: int | None


#: A command's reply: the document (after an acquire, before a release) and the
#: releases (owner, token) that the command carried; or the error that failed it.
_Answer = tuple[Mapping[str, Any] | None, tuple[tuple[str, int | None], ...]] | Exception


class MongoPermits:
    """The permits of one backend object.

    :param collection: the permits collection (pymongo or motor; the backend's concerns)
    :param where: ``database.collection``, as messages name it
    :param writer: the acquire's and release's commands on ``collection`` (see ``_writes``)
    :param mapped: maps driver errors (the backend's URL scrubbed)
    :param stamp: the backend's next ``by`` stamp (its id, a colon, a count)
    :param own: the backend's id (its own releases are left out of the stream)
    :param poll_interval: how often a waiter looks again while no stream is open
    :param watch: whether to open a change stream
    """

    def __init__(
        self,
        collection: Any,
        where: str,
        writer: Writer,
        *,
        mapped: Callable[[], AbstractContextManager[None]],
        stamp: Callable[[], str],
        own: str,
        poll_interval: float,
        watch: bool,
    ) -> None:
        self._coll = collection
        self._writer = writer
        self._where = where
        self._mapped = mapped
        self._stamp = stamp
        self._poll_interval = poll_interval
        self._watches = watch
        #: name -> owner -> the event of its task in :meth:`wait_turn`.
        self._waiters: dict[str, dict[str, asyncio.Event]] = {}
        #: (name, owner) that a release here fitted before it waited (see ``_fits``).
        self._early: set[tuple[str, str]] = set()
        self._closing = asyncio.Event()
        self._stream = Stream(
            collection,
            self._freed,
            self._lost,
            retry_after=poll_interval,
            pipeline=permit_watch_pipeline(own),
            parse=freed_name,
        )
        #: name -> releases of it seen (own, or from the stream).
        self._rung: dict[str, int] = {}
        self._losses = 0
        #: (name, owner) -> its latest refusal's :data:`Mark`.
        self._marks: dict[tuple[str, str], Mark] = {}
        #: (name, owner) -> the limit of its latest request refused here (its queue
        #: entry's), until it is granted or released.
        self._refused: dict[tuple[str, str], int] = {}
        #: (name, owner) -> (token, limit, seconds left, send time of the release): a
        #: release here granted its queue entry (see ``_hand``).
        self._handed: dict[tuple[str, str], tuple[int, int, float, float]] = {}
        #: Names whose latest release here left no entry (see ``_take_free``).
        self._free: set[str] = set()
        #: Acquire commands sent.
        self.commands = 0
        #: Grants taken from a release's reply, without a command.
        self.handed = 0
        self._tasks = Tasks(logger)
        #: A name's acquires and releases here: one command of the name in flight at
        #: once; those asked meanwhile go together in the next (see :meth:`_send_many`).
        self.combiner: Combiner[_Acquire | _Release, _Answer] = Combiner(
            self._send_one, self._send_many, self._tasks, most=_MOST
        )
        #: Tasks in :meth:`wait_turn` now.
        self.waiting = 0

    def no_streams(self) -> None:
        """The server has no change streams (a standalone mongod): waiters poll."""
        self._stream.available = False

    # -- wake-ups ------------------------------------------------------------------------

    def _mark(self, name: str) -> Mark:
        return (
            self._rung.get(name, 0),
            self._losses,
            self._stream.opens if self._stream.up else -1,
        )

    def _ring(self, name: str) -> None:
        """A release of ``name`` by somebody else: every refusal of it before now asks
        again at once, and its waiters here are woken."""
        if len(self._rung) >= _MAX_MARKS:
            self._rung.clear()
            self._losses += 1  # every mark now differs: its waiter asks again
        self._rung[name] = self._rung.get(name, 0) + 1
        for event in self._waiters.get(name, {}).values():
            event.set()

    def _fits(self, name: str, owners: Collection[str]) -> None:
        """A release here granted ``owners``' queued requests (see :meth:`_hand`): only
        their waiters are woken, or, if not waiting yet, return at once when they do.
        The others stay asleep: the release granted them nothing."""
        waiters = self._waiters.get(name, {})
        for owner in owners:
            event = waiters.get(owner)
            if event is not None:
                event.set()
            else:
                if len(self._early) >= _MAX_MARKS:
                    self._early.clear()
                    self._losses += 1  # every mark now differs: its waiter asks again
                self._early.add((name, owner))

    def _wake_all(self) -> None:
        for waiters in self._waiters.values():
            for event in waiters.values():
                event.set()

    def _freed(self, name: str) -> None:
        """A release of ``name`` by another backend object (a change event)."""
        self._ring(name)

    def _lost(self) -> None:
        """The stream ended (events may have been missed): every waiter asks again."""
        self._losses += 1
        self._wake_all()

    def _remember(self, name: str, owner: str, mark: Mark) -> None:
        if len(self._marks) >= _MAX_MARKS:
            for key in list(self._marks)[: _MAX_MARKS // 2]:
                del self._marks[key]
        self._marks[name, owner] = mark

    # -- the operations ------------------------------------------------------------------

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
        """One ``findAndModify`` upsert (see :func:`~._permit_acquire.acquire`); its outcome read
        from the document after it. Two first upserts that race: the loser (a duplicate
        key) asks once more, and finds the winner's document. A name whose latest
        release here left no entry is asked for with a short command first
        (:meth:`_take_free`)."""
        from pymongo.errors import DuplicateKeyError

        ttl = float(ttl)
        handed = self._handed.pop((name, owner), None)
        if handed is not None:
            token, asked, left, sent_at = handed
            # Only with the limit of its queue entry (else the command raises
            # LimitMismatchError), and while fresh (else the command renews it).
            if asked == limit and now() - sent_at < ttl * _FRESH_SHARE:
                self.handed += 1
                return self._granted(name, owner, token, min(ttl, left), sent_at)
        if name in self._free:
            self._free.discard(name)
            granted = await self._take_free(name, owner, ttl, identity, metadata, limit, weight)
            if granted is not None:
                return granted
        request = _Acquire(
            (owner, millis(ttl), identity, metadata, limit, weight, millis(ttl * _FRESH_SHARE))
        )
        mark = self._mark(name)
        for _ in range(2):
            sent_at = now()
            with self._mapped():
                # Seen to its end even if the caller is cancelled (see ``Combiner.run``).
                answer = await self.combiner.run(name, request, gather=name in self._waiters)
                if isinstance(answer, DuplicateKeyError):
                    continue
                if isinstance(answer, Exception):
                    raise answer
            doc = answer[0]
            rows = permits.parse(self._where, name, doc)
            if rows and rows[0].limit != limit:  # first, as the pipeline decides
                raise LimitMismatchError(name, limit, rows[0].limit)
            mine = next((row for row in rows if row.owner == owner), None)
            if mine is not None and mine.granted:
                return self._granted(name, owner, mine.token, ttl, sent_at)
            self._remember(name, owner, mark)
            if len(self._refused) >= _MAX_MARKS:
                self._refused.clear()  # requests that never came back (a safety net)
            self._refused[name, owner] = limit
            return blocker(name, rows, owner)
        raise BackendTimeout(f"permits of {name!r}: first upserts kept racing; try again")

    async def _take_free(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | None:
        """The grant of a name whose document has no entry (:func:`~._permit_acquire.free_filter`):
        one short ``findAndModify`` (not an upsert), which the server parses in a
        fraction of the full acquire's time. ``None``: the document was not free after
        all (or foreign, or gone): the full acquire decides.

        Sent again by :class:`Writer` after a failover, it finds the permit of its first
        try (the document is no longer free), and the full acquire answers as for a
        retry: the same token."""
        sent_at = now()
        self.commands += 1
        with self._mapped():
            # Seen to its end even if the caller is cancelled (see ``finished``).
            doc = await finished(
                self._writer.find_and_modify(
                    acquiring.free_filter(name),
                    acquiring.take_free(owner, millis(ttl), identity, metadata, limit, weight),
                    fields=acquiring.TAKEN,
                    new=True,
                )
            )
        if doc is None:
            return None
        return self._granted(name, owner, int(doc["token"]), ttl, sent_at)

    def _granted(self, name: str, owner: str, token: int, ttl: float, sent_at: float) -> Grant:
        self._marks.pop((name, owner), None)
        self._early.discard((name, owner))
        self._refused.pop((name, owner), None)
        self._handed.pop((name, owner), None)
        return Grant(token, ttl, sent_at=sent_at)

    async def read(self, name: str) -> PermitHolders | None:
        with self._mapped():
            doc = await whole(self._coll.find_one({"_id": name}, permits.READ))
        return permit_holders(name, permits.parse(self._where, name, doc))

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Return when a permit of ``name`` is released (through this object, or seen on
        the change stream), when ``seen`` runs out, after a third of ``ttl`` (the caller
        then keeps its queue entry alive), and without a stream after
        :attr:`poll_interval`; at once if a release came since ``owner``'s refusal, or
        the stream opened since (the release may have come before it)."""
        mark = self._marks.pop((name, owner), None)
        streaming = False
        if self._watches:
            with self._mapped():
                streaming = await self._stream.ensure()
        timeout = ttl * _REFRESH_SHARE
        if seen.remaining is not None:
            timeout = min(timeout, seen.remaining)
        timeout = min(timeout, _PUSH_CHECK if streaming else self._poll_interval)
        if (mark is not None and mark != self._mark(name)) or (name, owner) in self._early:
            self._early.discard((name, owner))
            return
        event = asyncio.Event()
        waiters = self._waiters.setdefault(name, {})
        waiters[owner] = event
        self.waiting += 1
        try:
            await wait_event(event, max(0.0, timeout))
        finally:
            self.waiting -= 1
            if waiters.get(owner) is event:
                del waiters[owner]
            if not waiters and self._waiters.get(name) is waiters:
                del self._waiters[name]

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        """Drop ``owner``'s permit (of ``token``, if given) and its queue entry of
        ``name`` (whatever ``token`` is): one ``findAndModify``; whether a live permit
        was freed."""
        self._marks.pop((name, owner), None)
        self._early.discard((name, owner))
        self._refused.pop((name, owner), None)
        self._handed.pop((name, owner), None)
        sent_at = now()
        with self._mapped():
            answer = await self.combiner.run(name, _Release(owner, token), to_end=False)
            if isinstance(answer, Exception):
                raise answer
        after, released = answer
        if after is None:
            return False
        if after.get("entries") == []:
            self._seen_free(name)
        self._hand(name, after, sent_at)
        index = released.index((owner, token))
        flags = permits.freed_flags(after)
        return len(flags) == len(released) and flags[index] == "1"

    def _hand(self, name: str, after: Mapping[str, Any], sent_at: float) -> None:
        """The release sent at ``sent_at`` left ``after``: the refused requests here that
        it shows granted (the release grants the queue entries that fit) take their
        grants without a command (:meth:`try_acquire`), and only their waiters are
        woken. The others stay asleep: the release changed nothing for them."""
        granted = permits.granted_in(after)
        owners = []
        for owner, (token, limit, left) in granted.items():
            asked = self._refused.get((name, owner))
            if asked is not None:
                if len(self._handed) >= _MAX_MARKS:
                    self._handed.clear()  # grants nobody took (a safety net)
                self._handed[name, owner] = (token, limit, left, sent_at)
                owners.append(owner)
        self._fits(name, owners)

    # -- one command per name in flight ---------------------------------------------------

    async def _send_one(self, name: str, op: _Acquire | _Release) -> _Answer:
        """``op`` alone."""
        return (await self._send_many(name, [op]))[0]

    async def _send_many(self, name: str, ops: Sequence[_Acquire | _Release]) -> list[_Answer]:
        """``ops``, the releases first (:func:`_releases_first`), each run of acquires,
        and each of releases, in one command: the acquires' pipelines one after the
        other in one upsert (each reads its outcome from the document after), the
        releases' likewise, on the document that one of them matches, then the grants of
        the queue entries that fit (each reads the document after: what it freed, whom
        the write granted). A command that fails answers its error to its operations
        only: those of the runs before it were done."""
        order = _releases_first(ops)
        answers: list[_Answer | None] = [None] * len(ops)
        start = 0
        while start < len(order):
            end = start + 1
            kind = type(ops[order[start]])
            while end < len(order) and type(ops[order[end]]) is kind:
                end += 1
            run = [ops[i] for i in order[start:end]]
            try:
                if kind is _Acquire:
                    answer: _Answer = (await self._acquire_run(name, run), ())
                else:
                    released = tuple((op.owner, op.token) for op in run)  # type: ignore[union-attr]
                    answer = (await self._release_run(name, released), released)
            except Exception as exc:
                answer = exc
            for i in order[start:end]:
                answers[i] = answer
            start = end
        return [answer for answer in answers if answer is not None]

    async def _acquire_run(self, name: str, run: Sequence[_Acquire | _Release]) -> Any:
        self.commands += 1
        requests = [op.request for op in run]  # type: ignore[union-attr]
        if len(requests) == 1:
            stages = acquiring.acquire(*requests[0])
        else:  # one stage for all: parsed once (see acquire_many)
            stages = acquiring.acquire_many(requests)
        return await self._writer.find_and_modify(
            {"_id": name}, stages, fields=permits.READ, upsert=True, new=True
        )

    async def _release_run(self, name: str, released: tuple[tuple[str, int | None], ...]) -> Any:
        if len(released) == 1:
            owner, token = released[0]
            query = permits.release_filter(name, owner, token)
        else:
            query = permits.release_many_filter(name, released)
        return await whole(
            self._writer.find_and_modify(
                query,
                permits.release_pipeline(released, self._stamp()),
                fields=permits.RELEASED_AFTER,
                new=True,
            )
        )

    def _seen_free(self, name: str) -> None:
        """A release here left ``name``'s document without any entry: its next acquire
        here tries the short command first (a hint only: the command's filter checks)."""
        if len(self._free) >= _MAX_MARKS:
            self._free.clear()
        self._free.add(name)

    async def renew(self, renewals: Sequence[Renewal]) -> list[RenewResult]:
        """The permits of ``renewals`` in one unordered ``bulk_write``: one update per
        name (and ttl) for all its permits, which matches only if every one of them is
        live; if one did not match, one update per permit, and then, if some did not
        match, one ``find`` tells which are still held."""
        from pymongo import UpdateOne

        groups: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for name, owner, token, ttl in renewals:
            groups.setdefault((name, millis(ttl)), []).append((owner, token))
        sent_at = now()
        if all(len(set(pairs)) == len(pairs) for pairs in groups.values()):
            grouped = [
                UpdateOne(
                    permits.renew_all_filter(name, pairs), permits.renew_all_update(pairs, ttl_ms)
                )
                for (name, ttl_ms), pairs in groups.items()
            ]
            with self._mapped():
                result = await whole(self._coll.bulk_write(grouped, ordered=False))
            if result.matched_count == len(grouped):
                return [Grant(token, float(ttl), sent_at=sent_at) for _, _, token, ttl in renewals]
        ops = [
            UpdateOne(
                {"_id": name, "$expr": permits.live_expr(owner, token)},
                permits.renew_update(owner, token, millis(ttl)),
            )
            for name, owner, token, ttl in renewals
        ]
        with self._mapped():
            result = await whole(self._coll.bulk_write(ops, ordered=False))
        if result.matched_count == len(ops):
            return [Grant(token, float(ttl), sent_at=sent_at) for _, _, token, ttl in renewals]
        with self._mapped():
            docs = await whole(
                self._coll.find(
                    {"_id": {"$in": list({r[0] for r in renewals})}}, permits.READ
                ).to_list(None)
            )
        live: set[tuple[str, str, int]] = set()
        for doc in docs:
            for row in permits.parse(self._where, doc["_id"], doc):
                if row.granted:
                    live.add((doc["_id"], row.owner, row.token))
        return [
            Grant(token, float(ttl), sent_at=sent_at)
            if (name, owner, token) in live
            else NotOwnerError(name)
            for name, owner, token, ttl in renewals
        ]

    async def closed(self) -> None:
        """Return once :meth:`aclose` was called."""
        await self._closing.wait()

    async def aclose(self) -> None:
        """Stop the stream; wake every waiter."""
        self._closing.set()
        self._wake_all()
        await self._tasks.aclose()
        await self._stream.aclose()


def _releases_first(ops: Sequence[_Acquire | _Release]) -> list[int]:
    """The order to send ``ops`` in (their indexes): every release ahead of the
    acquires, unless an acquire of the same owner came before it (a cancelled acquire's
    compensating release stays behind it); otherwise in the order asked. Operations
    that wait together for a name's next command were asked at once: no order between
    two owners' is promised, and a release first serves the queue first (it grants the
    entries that then fit, in arrival order) and spares a refusal that it would grant
    right after. Runs of one kind go in one command each: two commands for a mixed
    batch, not one per change of kind."""
    acquiring: set[str] = set()
    first: list[int] = []
    rest: list[int] = []
    for i, op in enumerate(ops):
        if isinstance(op, _Release) and op.owner not in acquiring:
            first.append(i)
        else:
            rest.append(i)
            if isinstance(op, _Acquire):
                acquiring.add(op.owner)
    return first + rest
