"""Hand-offs of permits within one backend object (see ``docs/internals/zookeeper.md``,
*Hand-off within one backend object*): a release that grants the next request
waiting at the same backend in its own write (one ``Multi``), and the *reserved*
requests, granted as that write is made (their token is their create's zxid). The
state they use is :class:`~._permits.Permits`'s; these functions are its release
path, kept apart.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from ..._exceptions import LossReason
from ._permit_nodes import PermitNode, fitting, with_token
from ._session import Entry

if TYPE_CHECKING:
    from ._permits import Permits

__all__ = ["passed", "release_now", "reserve", "settle"]


def release_now(permits: Permits, entry: Entry) -> Awaitable[bool] | None:
    """Release ``entry`` (a permit held here): its delete written before returning,
    in one ``Multi`` with the ``SetData`` that grants the first request queued here
    that its going lets in (:func:`_successor`), if there is one; whether it was
    freed, once answered. ``None`` (nothing written): the connection is not up."""
    full = permits.wire.path(entry.path)
    successor = _successor(permits, entry)
    if successor is None:
        replies = permits.wire.send_now(permits.wire.delete(full))
        if replies is None:
            return None
        permits.keeper.end(entry, LossReason.RELEASED, quietly=True)
        return _deleted(permits, replies, entry)
    key = (successor.name, successor.owner)
    reserved = permits.reserved.get(successor.name, {})
    told = successor.owner in reserved  # its token: its create's zxid
    held = with_token(permits.asks[key], successor.token) if told else permits.asks[key]
    grant = permits.wire.set_data(permits.wire.path(successor.path), held)
    multi = permits.wire.multi(permits.wire.delete(full), grant)
    if told:
        # Granted as the release is written: its token is known already.
        replies = permits.wire.send_now(multi)
        if replies is None:
            return None
        del reserved[successor.owner]
        _tell(permits, successor, held)
        permits.keeper.end(entry, LossReason.RELEASED, quietly=True)
        return _released(permits, replies, entry, successor)
    busy: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    then = functools.partial(_handed_off, permits, successor, held, busy)
    replies = permits.wire.send_now(multi, then=then)
    if replies is None:
        return None
    permits.revoke(successor.name)  # its token is the Multi's zxid: new
    permits.busy[key] = busy
    permits.keeper.end(entry, LossReason.RELEASED, quietly=True)
    return _released(permits, replies, entry)


def _tell(permits: Permits, successor: Entry, held: bytes) -> None:
    """``successor`` is granted (by a release here): its next try takes the grant,
    and its wait ends."""
    successor.data = held
    successor.queued = False
    permits.handed.add((successor.name, successor.owner))
    wake = permits.waiting.get(successor.name, {}).get(successor.owner)
    if wake is not None and not wake.done():
        wake.set_result(None)


def _successor(permits: Permits, entry: Entry) -> Entry | None:
    """The first request waiting here that the name's view shows granted once
    ``entry``'s node (and every node of an ended entry) is gone, if one is.

    Safe on a view however old: it lists every node still there that came before
    the request's (nodes only join at the end, and it shows the request's own), so
    the nodes of live requests before it weigh no more there than they do now."""
    listed = permits.views.get(entry.name)
    if listed is None or entry.session_id != permits.wire.session_id:
        return None
    waiting = permits.waiting.get(entry.name)
    if not waiting:
        return None
    gone = entry.path.rsplit("/", 1)[1]
    queue = [n for n in permits.live(listed) if n.node != gone]
    reserved = permits.reserved.get(entry.name, {})
    for node in queue[: fitting(queue)]:
        key = (entry.name, node.owner)
        mine = permits.keeper.entries.get(key)
        if (
            node.owner in waiting
            and mine is not None
            and mine.queued
            and mine.reason is None
            and mine.session_id == entry.session_id
            and key in permits.asks
            and key not in permits.busy
            and mine.path == permits.layout.path(entry.name, node.node)
        ):
            return mine
        if node.owner in reserved:  # passed over: the ones behind take new tokens
            permits.revoke(entry.name)
    return None


def _handed_off(
    permits: Permits,
    successor: Entry,
    held: bytes,
    busy: asyncio.Future[None],
    reply: asyncio.Future[Any],
) -> None:
    """The ``Multi`` of a release that grants ``successor`` was answered (or failed):
    granted, its token the zxid of that write, and its wait ends."""
    key = (successor.name, successor.owner)
    if permits.busy.get(key) is busy:
        del permits.busy[key]
    token = _multi_grant(reply)
    if token is not None and successor.reason is None and successor.queued:
        successor.token = token
        successor.data = held
        successor.queued = False
        permits.handed.add(key)
    settle(busy)
    wake = permits.waiting.get(successor.name, {}).get(successor.owner)
    if wake is not None and not wake.done():
        wake.set_result(None)


async def _released(
    permits: Permits, replies: Awaitable[list[Any]], entry: Entry, told: Entry | None = None
) -> bool:
    """Whether the release ``Multi`` of ``entry`` freed it; if it changed nothing
    (the other node in it went), its node is deleted alone (and the node of
    ``told``, granted as the ``Multi`` was written, marked held if it lives)."""
    try:
        (reply,) = await replies
    except BaseException:
        permits.keeper.zombies[entry.path] = entry.session_id
        raise
    if _results_granted(reply) is not None:
        return True
    requests = [permits.wire.delete(permits.wire.path(entry.path))]
    if told is not None and told.reason is None:
        requests.append(permits.wire.set_data(permits.wire.path(told.path), told.data))
    (deleted, *_) = await permits.wire.send(*requests)
    return not isinstance(deleted, Exception)


async def _deleted(permits: Permits, replies: Awaitable[list[Any]], entry: Entry) -> bool:
    """Whether the delete of ``entry``'s node freed it. One whose reply did not come
    is deleted again by the keeper (the session may live on, and the node with it)."""
    try:
        (deleted,) = await replies
    except BaseException:
        permits.keeper.zombies[entry.path] = entry.session_id
        raise
    return not isinstance(deleted, Exception)


def reserve(permits: Permits, entry: Entry, ahead: list[PermitNode]) -> None:
    """Make ``entry`` (a request just refused, ``ahead`` the live nodes before its
    own) *reserved* when each of them is a live entry of this backend that holds,
    with a smaller token, or is reserved itself: its token is then its create's
    zxid, and a release here can grant it as the release is written.

    Why that is safe: every node before it is this backend's, so it starts to fit
    only when this backend ends one of them (:func:`release_now`, :meth:`Permits.ended`),
    and it is then granted at once, or its reservation is revoked; no node behind
    it (of any session) can be granted before it, and every grant before it had a
    smaller token. Granting any request of the name with a new token first revokes
    the reservations of those before it, and of every one behind those
    (:meth:`Permits.revoke`): reserved requests are granted in the order of their nodes."""
    name = entry.name
    reserved = permits.reserved.get(name, {})
    for node in ahead:
        mine = permits.keeper.entries.get((name, node.owner))
        if (
            mine is None
            or mine.reason is not None
            or mine.session_id != entry.session_id
            or not mine.path.endswith(node.node)
        ):
            return
        if (node.owner not in reserved) if mine.queued else (mine.token >= entry.token):
            return
    permits.reserved.setdefault(name, {})[entry.owner] = entry.sequence


def passed(permits: Permits, name: str, queue: list[PermitNode]) -> None:
    """Revoke the reservation of each reserved request of ``name`` that ``queue``
    shows granted (not granted as it came to fit: it would be granted later, after
    others behind it may have been), and of those behind."""
    reserved = permits.reserved.get(name)
    if not reserved:
        return
    for node in queue[: fitting(queue)]:
        if node.owner in reserved:
            permits.revoke(name)
            return


def _multi_grant(reply: asyncio.Future[Any]) -> int | None:
    """The zxid of a release ``Multi`` whose reply future is ``reply``, if it was applied."""
    if reply.cancelled() or reply.exception() is not None:
        return None
    _, response = reply.result()
    return _results_granted(response)


def _results_granted(response: Any) -> int | None:
    """The zxid of the ``SetData`` that ends the ``Multi`` answered by ``response`` (ours
    parsed by ``._codec``, or aiozk's), if the ``Multi`` was applied (else its results
    are error codes)."""
    results = getattr(response, "results", None)
    if results is None:
        results = getattr(response, "responses", None)
    if not results:
        return None
    stat = getattr(results[-1], "stat", None)
    return None if stat is None else int(stat.last_modified_zxid)


def settle(future: asyncio.Future[None]) -> None:
    """Set ``future`` (if it is not done yet)."""
    if not future.done():
        future.set_result(None)
