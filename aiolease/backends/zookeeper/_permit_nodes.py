"""Where the nodes of permits (semaphores, read-write locks) live, what their names and
data say, and the grant rule over them.

Layout (``base`` is ``<chroot>/<prefix>``)::

    <base>/<quoted name>%permits/_c_<quoted owner>-p<limit>x<weight>-<sequence>

* The *permits node* of a name is a container node beside the name's lock node
  (``%permits`` cannot end a quoted name: a quoted ``%`` is followed by two hex
  digits), so a lock and a semaphore of one name never see each other.
* Each permit request puts one ephemeral sequential node under it: the owner id
  (found again after a lost reply, as for locks), the limit and the weight asked
  for, all in the node's *name*, so that one listing decides a request. The
  sequence orders the requests: readers, writers and semaphore permits alike.
* Its data is JSON: ``{"i": identity, "m": metadata, "h": held}``; ``h`` is what its
  owner was told (granted, or queued): what :meth:`read_permits` reports, with the
  token ``t`` of a grant whose token is not the zxid of the write that marked the
  node held (a reserved request's: its create's zxid). The grant rule itself reads
  names only.

**The grant rule** (``docs/internals/zookeeper.md#permits``): the node at position
``k`` is granted iff every node before it has its limit and the weights of the
nodes before it plus its own fit in the limit. Nodes only ever join at the end, so
once a node fits it fits until it is deleted, and the nodes that fit are a prefix of
the queue whose weights fit in the limit.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import unquote

from ..._exceptions import ForeignDataError
from ._nodes import _quote

__all__ = [
    "PermitLayout",
    "PermitNode",
    "Standing",
    "decode_permit",
    "encode_permit",
    "fitting",
    "foreign_permit",
    "standing",
    "with_token",
]

_HEAD = "_c_"
_SUFFIX = "%permits"
_DIGITS = 10
#: The most child nodes :class:`PermitLayout` remembers parsed (then it forgets them all).
_MOST_PARSED = 4096


@dataclass(frozen=True, order=True)
class PermitNode:
    """One permit node of a name, as its name says."""

    sequence: int
    node: str
    owner: str
    limit: int
    weight: int


def encode_permit(
    identity: str, metadata: Mapping[str, str], held: bool, token: int | None = None
) -> bytes:
    """The data of a permit node (``token``: the grant's, when it is not the zxid of the
    write that marks the node held)."""
    if not metadata:
        data = _bare_permit(identity, held)  # the same bytes each time
    else:
        document = {"i": identity, "m": dict(metadata), "h": held}
        data = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()
    return data if token is None else with_token(data, token)


def with_token(data: bytes, token: int) -> bytes:
    """``data`` (as :func:`encode_permit` makes it, without a token) with ``token``."""
    return b'%s,"t":%d}' % (data[:-1], token)


@functools.lru_cache(maxsize=256)
def _bare_permit(identity: str, held: bool) -> bytes:
    document = {"i": identity, "m": {}, "h": held}
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()


def decode_permit(data: bytes | None) -> tuple[str, dict[str, str], bool, int | None]:
    """``(identity, metadata, held, token)`` of a permit node's data (``token`` ``None``:
    the zxid of the write that marked the node held is the grant's token).

    :raises ValueError: it is not data aiolease writes
    """
    record = json.loads((data or b"").decode())
    if not isinstance(record, dict) or not {"i", "m", "h"} <= set(record) <= _KEYS:
        raise ValueError("not a JSON object of keys i, m and h (and t)")
    identity, metadata, held = record["i"], record["m"], record["h"]
    token = record.get("t")
    if not isinstance(identity, str) or not isinstance(metadata, dict):
        raise ValueError("identity or metadata of the wrong type")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("metadata is not a str -> str map")
    if not isinstance(held, bool):
        raise ValueError("held is not a boolean")
    if token is not None and (type(token) is not int or token < 1 or not held):
        raise ValueError("token is not a positive integer of a held node")
    return identity, metadata, held, token


_KEYS = frozenset({"i", "m", "h", "t"})


def _number(text: str) -> int:
    if not text.isdigit() or text != str(int(text)) or int(text) < 1:
        raise ValueError(text)
    return int(text)


class PermitLayout:
    """Paths of permit nodes under one base node.

    :param base: ``<chroot>/<prefix>``, absolute, without a trailing ``/``
    """

    def __init__(self, base: str) -> None:
        self.base = base
        #: The child nodes parsed lately (a queue's children are listed again and again,
        #: and each parse unquotes the owner id twice).
        self._parsed: dict[str, PermitNode] = {}

    def permits_node(self, name: str) -> str:
        """The container node of ``name``'s permits."""
        return f"{self.base}/{_quote(name)}{_SUFFIX}"

    def new_node(self, name: str, owner: str, limit: int, weight: int) -> str:
        """The path to create ``owner``'s sequential permit node at."""
        return f"{self.permits_node(name)}/{_HEAD}{_quote(owner)}-p{limit}x{weight}-"

    def path(self, name: str, node: str) -> str:
        """The full path of the child ``node`` of ``name``'s permits node."""
        return f"{self.permits_node(name)}/{node}"

    def parse(self, name: str, node: str) -> PermitNode:
        """What the child ``node`` of ``name``'s permits node stands for (what it stands
        for does not depend on ``name``: a node parsed before is answered from memory).

        :raises ForeignDataError: it is not a node aiolease creates
        """
        parsed = self._parsed.get(node)
        if parsed is None:
            parsed = _parse(name, node)
            if len(self._parsed) >= _MOST_PARSED:
                self._parsed.clear()
            self._parsed[node] = parsed
        return parsed

    def known(self, node: PermitNode) -> None:
        """Remember ``node`` as parsed (a node this backend just created: what its name
        says is known without parsing it)."""
        if len(self._parsed) >= _MOST_PARSED:
            self._parsed.clear()
        self._parsed[node.node] = node

    def queue(self, name: str, children: Iterable[str]) -> list[PermitNode]:
        """The permit nodes of ``name`` in arrival order.

        :raises ForeignDataError: a child is not aiolease's
        """
        # By sequence number alone (unique under one parent): the dataclass's order
        # compares field tuples, several times dearer.
        return sorted((self.parse(name, child) for child in children), key=_sequence)


def _sequence(node: PermitNode) -> int:
    return node.sequence


def _parse(name: str, node: str) -> PermitNode:
    """:meth:`PermitLayout.parse`, computed.

    :raises ForeignDataError: it is not a node aiolease creates
    """
    rest, _, digits = node.rpartition("-")
    head, _, spec = rest.rpartition("-")
    limit_text, cross, weight_text = spec[1:].partition("x")
    quoted = head[len(_HEAD) :]
    try:
        if (
            not head.startswith(_HEAD)
            or not spec.startswith("p")
            or not cross
            or len(digits) != _DIGITS
            or not digits.isdigit()
            or _quote(unquote(quoted)) != quoted
        ):
            raise ValueError(node)
        limit, weight = _number(limit_text), _number(weight_text)
    except ValueError:
        raise foreign_permit(name, node, "its name is not one aiolease gives") from None
    return PermitNode(int(digits), node, unquote(quoted), limit, weight)


@dataclass(frozen=True)
class Standing:
    """Where one node of a queue stands: the weight of the nodes up to it (its own
    included), and the first limit among them that is not the one asked with
    (``None``: all agree)."""

    ahead: int
    other_limit: int | None


def standing(queue: list[PermitNode], end: int, limit: int) -> Standing:
    """Where the node ``queue[end - 1]`` stands, asking with ``limit``: it is granted
    iff ``other_limit is None and ahead <= limit``."""
    ahead, other = 0, None
    for node in queue[:end]:
        ahead += node.weight
        if other is None and node.limit != limit:
            other = node.limit
    return Standing(ahead, other)


def fitting(queue: list[PermitNode]) -> int:
    """How many nodes at the head of ``queue`` are granted."""
    ahead = 0
    for index, node in enumerate(queue):
        if node.limit != queue[0].limit or ahead + node.weight > node.limit:
            return index
        ahead += node.weight
    return len(queue)


def foreign_permit(name: str, node: str, why: str) -> ForeignDataError:
    """The error for a node under ``name``'s permits node that aiolease did not write."""
    return ForeignDataError(
        f"ZooKeeper node {node!r} of the permits of {name!r}: {why}; it was left"
        " unchanged, and nothing is granted over it: another program seems to write under"
        " this backend's prefix; give aiolease another prefix",
        name=name,
    )
