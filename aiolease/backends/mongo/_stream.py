"""One change stream per backend object: what wakes its waiters and ends its holders.

The stream watches the lease collection (never one stream per waiter), without the
backend's own writes and without renewals (see :func:`watch_pipeline`), and turns
each change event into a :class:`Notice`: a grant (an owner and its new token: a first
upsert, a takeover of an expired lease, a hand-off to a waiter) or a release (the
token released, which the release writes to ``released`` so that its event says
which grant ended). Renewals and queue changes are no notice. Events come in the
order of the oplog, and tokens only grow, so a late event is told from a new one by
its token alone (see :class:`~aiolease.backends._takers.Takers`).

The stream is opened before a waiter reads (so a change after the read is seen),
by :meth:`Stream.ensure`. When it fails, every waiter is woken (events may have been
missed: each reads again), and the next wait opens it again, at most once per
``retry_after`` seconds. A server without change streams (a standalone mongod,
error 40573) turns it off for good: waiters then sleep until the holder's ttl runs
out. Driver-free: it gets the collection from the backend.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .._asyncio import now, retrieve, wait_event
from ._errors import NO_CHANGE_STREAMS, code_of
from ._permits import FREED
from ._pipelines import BY, PROCLAIMED, RELEASED

__all__ = ["Notice", "Stream", "freed_name", "notice_of", "permit_watch_pipeline"]

logger = logging.getLogger("aiolease.backends.mongo")

#: Longest wait for the server to open the stream before a waiter polls instead.
OPEN_TIMEOUT = 5.0
#: Events that may change a holder (the rest, like ``invalidate``, end the stream).
_OPERATIONS = ["insert", "update", "replace", "delete"]


@dataclass(frozen=True, slots=True)
class Notice:
    """What one change event says about lease ``name``.

    :param owner: the owner granted (``None``: a release, or the document was deleted)
    :param token: the token granted or released (``None``: unknown, a deletion)
    :param left: seconds the grant had left when it was written (its ``expires`` minus
        the event's ``wallTime``: both the server's clock), if known
    """

    name: str
    owner: str | None
    token: int | None
    left: float | None = None
    #: the holder's metadata changed (no grant, no release: nobody is taken)
    proclaimed: bool = False


def _left(expires: object, change: Mapping[str, Any]) -> float | None:
    wall = change.get("wallTime")
    if isinstance(expires, datetime) and isinstance(wall, datetime):
        return (expires - wall).total_seconds()
    return None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def notice_of(change: Mapping[str, Any]) -> Notice | None:
    """The notice of one change event, or ``None`` when it changes no holder."""
    key = change.get("documentKey") or {}
    name = key.get("_id")
    if not isinstance(name, str):
        return None
    kind = change.get("operationType")
    if kind == "delete":
        return Notice(name, None, None)
    if kind in ("insert", "replace"):
        doc = change.get("fullDocument") or {}
        owner = doc.get("owner")
        if isinstance(owner, str):
            return Notice(name, owner, _int(doc.get("token")), _left(doc.get("expires"), change))
        return Notice(name, None, _int(doc.get(RELEASED)))
    if kind != "update":
        return None
    update = change.get("updateDescription") or {}
    fields: Mapping[str, Any] = update.get("updatedFields") or {}
    removed = update.get("removedFields") or ()
    if "token" in fields:  # a new grant (a hand-off also releases the older token)
        owner = fields.get("owner")
        granted = owner if isinstance(owner, str) else None
        return Notice(name, granted, _int(fields["token"]), _left(fields.get("expires"), change))
    if RELEASED in fields or "owner" in removed:
        return Notice(name, None, _int(fields.get(RELEASED)))
    if PROCLAIMED in fields:
        return Notice(name, None, None, proclaimed=True)
    return None


def watch_pipeline(own: str | None) -> list[dict[str, Any]]:
    """What the server sends the stream: grants, releases, deletions and a holder's new
    metadata (not renewals, which change only ``expires``, nor queue changes), and not
    the writes of the backend whose ``by`` ids start with ``own`` (it acts on those when
    it makes them)."""
    fields = "updateDescription.updatedFields"
    changes: dict[str, Any] = {
        "$or": [
            {"operationType": {"$ne": "update"}},
            {f"{fields}.token": {"$exists": True}},
            {f"{fields}.{RELEASED}": {"$exists": True}},
            {"updateDescription.removedFields": "owner"},
            {f"{fields}.{PROCLAIMED}": {"$exists": True}},
        ]
    }
    stages: list[dict[str, Any]] = [{"operationType": {"$in": _OPERATIONS}}, changes]
    if own is not None:
        mine = {"$regex": f"^{re.escape(own)}:"}
        stages.append({f"{fields}.{BY}": {"$not": mine}})
        stages.append({f"fullDocument.{BY}": {"$not": mine}})
    return [{"$match": {"$and": stages}}]


def permit_watch_pipeline(own: str) -> list[dict[str, Any]]:
    """What the server sends the permits collection's stream: releases (updates that
    set ``freed``) by other backend objects, and deletions (see
    :mod:`aiolease.backends.mongo._permits`); grants, queue entries and renewals free
    nothing, and are left out."""
    freed = f"updateDescription.updatedFields.{FREED}"
    mine = {"$regex": f"^{re.escape(own)}:"}
    return [
        {
            "$match": {
                "$or": [
                    {"operationType": "delete"},
                    {"operationType": "update", freed: {"$exists": True, "$not": mine}},
                ]
            }
        }
    ]


def freed_name(change: Mapping[str, Any]) -> str | None:
    """The name whose permits a change event of :func:`permit_watch_pipeline` freed."""
    name = (change.get("documentKey") or {}).get("_id")
    return name if isinstance(name, str) else None


class _Invalidated(Exception):
    """The server ended the change stream."""


class Stream:
    """The change stream of one backend's lease collection, opened on demand.

    :param collection: the pymongo (or motor) collection
    :param notify: called with every :class:`Notice`
    :param lost: called when the stream ends (events may have been missed)
    :param retry_after: seconds before a failed stream is opened again
    :param own: the id the backend writes to ``by``: its own writes are left out
    :param pipeline: what the server sends (default: :func:`watch_pipeline` of ``own``)
    :param parse: what an event says (default :func:`notice_of`; ``None``: nothing),
        which ``notify`` is called with
    """

    def __init__(
        self,
        collection: Any,
        notify: Callable[[Any], None],
        lost: Callable[[], None],
        *,
        retry_after: float,
        own: str | None = None,
        pipeline: list[dict[str, Any]] | None = None,
        parse: Callable[[Mapping[str, Any]], object | None] = notice_of,
    ) -> None:
        self._collection = collection
        self._pipeline = watch_pipeline(own) if pipeline is None else pipeline
        self._parse = parse
        self._notify = notify
        self._lost = lost
        self._retry_after = retry_after
        self._task: asyncio.Task[None] | None = None
        self._opened: asyncio.Event | None = None
        self._failed_at: float | None = None
        #: Whether the server has change streams (``False`` for good after error 40573).
        self.available = True
        #: Whether the stream is open now.
        self.up = False
        #: How many times it was opened.
        self.opens = 0
        self._closed = False

    async def ensure(self) -> bool:
        """Open the stream unless it is open; whether it is open now (so that a change
        from now on will be notified)."""
        if self.up or not self.available or self._closed:
            await asyncio.sleep(0)
            return self.up
        if self._task is None or self._task.done():
            if self._failed_at is not None and now() - self._failed_at < self._retry_after:
                await asyncio.sleep(0)
                return False
            self._opened = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(self._opened))
            self._task.add_done_callback(retrieve)
        assert self._opened is not None
        await wait_event(self._opened, OPEN_TIMEOUT)
        return self.up

    async def _run(self, opened: asyncio.Event) -> None:
        try:
            watching = self._collection.watch(self._pipeline)
            if inspect.isawaitable(watching):  # pymongo's async client (motor's is not)
                watching = await watching
            async with watching as stream:
                if not inspect.iscoroutinefunction(getattr(type(self._collection), "watch", None)):
                    # motor opens its cursor on the first fetch: a change before it is seen
                    first = await stream.try_next()
                    if first is not None:
                        self._dispatch(first)
                self.up = True
                self.opens += 1
                opened.set()
                while not self._closed:
                    change = await stream.try_next()
                    if change is not None:
                        self._dispatch(change)
                    elif not stream.alive:
                        # Invalidated (the collection was dropped or renamed): a
                        # dead cursor answers at once, forever. Open a new one.
                        raise _Invalidated("the change stream was invalidated")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if code_of(exc) == NO_CHANGE_STREAMS:
                self.available = False
                logger.info("MongoDB has no change streams here (a standalone server): polling")
            elif not self._closed:
                logger.warning("MongoDB change stream failed: %r; waiters poll meanwhile", exc)
            self._failed_at = now()
        finally:
            self.up = False
            opened.set()
            if not self._closed:
                self._lost()

    def _dispatch(self, change: Mapping[str, Any]) -> None:
        notice = self._parse(change)
        if notice is not None:
            self._notify(notice)

    async def aclose(self) -> None:
        """Stop watching. Idempotent."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
