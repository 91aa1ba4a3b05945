"""Mirrors of the permit nodes of names this backend alone has lately been writing to:
a request's create then needs no listing of the name's nodes (one request fewer per
acquisition, and the largest reply; see ``docs/internals/zookeeper.md#permits``).

A *mirror* of a name is a listing of its nodes and the sequence number the next
create under its permits node gets if nobody else creates one meanwhile (the highest
sequence listed, plus one: sequence numbers grow by one per create under a parent,
deletes take none). It is kept up to date, in the order the server applied them, by
the replies to this backend's own requests: a listing (:meth:`Mirrors.listed`)
replaces it; a create of ours (:meth:`Mirrors.created`) whose sequence is exactly
the one expected joins it, and any other sequence (somebody else created a node
since: it would be missing) drops it; an entry of ours that ends leaves it
(:meth:`Mirrors.ended`: as :meth:`~._permits.Permits.live`, its node holds nothing).
Both run as done-callbacks of the replies' futures, which the server answers, and
the connection resolves, in the order it applied the requests: so the callbacks run
in that order too, whichever coroutine awaits what.

What a mirror may miss, and why that is safe: a node deleted by somebody else (a
delete takes no sequence number) stays in it, so a request counts more weight ahead
of it than there is: it may be refused where it would fit, then waits with a watch
and a listing (:meth:`~._permits.Permits.wait_turn`), which corrects the mirror;
never granted where it would not fit. A node created by somebody else is never
missed: it takes a sequence number, and our next create's sequence tells. A parent
reaped and made again (its sequences start at 0 again) cannot pass for the old one:
a mirror is trusted only while it lists a live node of ours on the current session
(:meth:`~._permits.Permits._trusted`), which keeps the container from being reaped.

Where other sessions create nodes too, a create alone would mostly find one before
it and need the listing after it, a round trip more: a name where that happened
sends its creates with a listing again (as without a mirror), and is trusted again
once such a create finds the sequence it expected.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ..._exceptions import ForeignDataError
from ._permit_nodes import PermitLayout, PermitNode

__all__ = ["Mirror", "Mirrors"]

#: How many names' mirrors are kept (the oldest forgotten first).
MIRRORS_LIMIT = 4096


@dataclass
class Mirror:
    """A name's nodes (arrival order), and the sequence number of the next create."""

    nodes: list[PermitNode]
    next: int


class Mirrors:
    """The mirrors of one backend object's names (see the module's docstring)."""

    def __init__(self, layout: PermitLayout) -> None:
        self.layout = layout
        self.by_name: dict[str, Mirror] = {}
        #: Names where a create of ours found another session's create before it: their
        #: creates go with a listing again (:meth:`trusted`) until one finds none.
        self.missed: dict[str, None] = {}

    def trusted(self, name: str) -> Mirror | None:
        """``name``'s mirror, unless its last create of ours found another's before it
        (then a create alone would mostly be a round trip more: the listing after it)."""
        return None if name in self.missed else self.by_name.get(name)

    def listed(self, name: str, reply: asyncio.Future[Any]) -> None:
        """A listing of ``name``'s nodes was answered (``reply``): the name's mirror."""
        self.by_name.pop(name, None)
        children = _result(reply, "children")
        if not children:
            return
        try:
            nodes = self.layout.queue(name, children)
        except ForeignDataError:
            return
        if len(self.by_name) >= MIRRORS_LIMIT:
            del self.by_name[next(iter(self.by_name))]
        self.by_name[name] = Mirror(nodes, nodes[-1].sequence + 1)

    def created(self, name: str, seen: list[list[PermitNode]], reply: asyncio.Future[Any]) -> None:
        """A create of ours under ``name``'s permits node was answered (``reply``): if
        its sequence is the one the mirror expects, its node joins the mirror and the
        mirror as it then is goes into ``seen`` (the create's listing); else the
        mirror goes."""
        mirror = self.by_name.pop(name, None)
        path = _result(reply, "path")
        if mirror is None or not path:
            return
        node = path.rsplit("/", 1)[1]
        try:
            parsed = self.layout.parse(name, node)
        except ForeignDataError:
            return
        if parsed.sequence != mirror.next:  # somebody else created a node meanwhile
            if name not in self.missed and len(self.missed) >= MIRRORS_LIMIT:
                del self.missed[next(iter(self.missed))]
            self.missed[name] = None
            return
        self.missed.pop(name, None)
        mirror.nodes.append(parsed)
        mirror.next = parsed.sequence + 1
        self.by_name[name] = mirror
        seen.append(list(mirror.nodes))

    def ended(self, name: str, node: str) -> None:
        """An entry of ours whose node is ``node`` ended: its node leaves the mirror."""
        mirror = self.by_name.get(name)
        if mirror is None:
            return
        for index, listed in enumerate(mirror.nodes):
            if listed.node == node:
                del mirror.nodes[index]
                return


def _result(reply: asyncio.Future[Any], attribute: str) -> Any:
    """``attribute`` of the response that ``reply`` (a request's future) holds, or
    ``None`` if it failed."""
    if reply.cancelled() or reply.exception() is not None:
        return None
    _, response = reply.result()
    return getattr(response, attribute, None)
