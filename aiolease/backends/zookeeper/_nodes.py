"""Where the nodes of a lease live, what their names and data say.

Layout (``base`` is ``<chroot>/<prefix>``)::

    <base>/<quoted name>/_c_<quoted owner>-lock-<sequence>

* The *name node* (``<base>/<quoted name>``) is a container node (ZooKeeper deletes
  it once it is empty): the lease name, percent-quoted (``/``, ``%`` and every byte
  outside ASCII letters, digits and ``_.-~``), so that each name is one path
  component and two names never share one.
* Each attempt puts one ephemeral sequential *contender* node under it. Its name
  starts with ``_c_`` and the owner id (Curator's "protected" mode): a request whose
  reply was lost is found again by its owner, never left behind. The contender with
  the lowest sequence holds the name; the others wait in sequence order.
* Its data is JSON: ``{"i": identity, "m": metadata}``. Its token is its ``czxid``,
  the id of the transaction that created it: ZooKeeper's transaction ids only grow
  over the ensemble's life, and contenders of a name are created in sequence order.

A child of a name node that is not shaped so, or whose data is not aiolease's, is
*foreign*: it is reported as :class:`~aiolease.ForeignDataError`, never deleted.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import quote, unquote

from ..._exceptions import ForeignDataError
from ..._records import HolderInfo

__all__ = ["DEFAULT_PREFIX", "Contender", "Layout", "decode_data", "encode_data"]

#: The node under the chroot that holds the leases, unless ``prefix`` says otherwise.
DEFAULT_PREFIX = "aiolease"
_HEAD = "_c_"
_MARK = "-lock-"
_DIGITS = 10


@functools.lru_cache(maxsize=4096)
def _quote(text: str) -> str:
    quoted = quote(text, safe="")
    # "." and ".." are not node names; quote() never writes "%2E" itself.
    return quoted.replace(".", "%2E") if quoted in (".", "..") else quoted


@dataclass(frozen=True, order=True)
class Contender:
    """One contender node of a name: its sequence (what orders the queue) and name."""

    sequence: int
    node: str
    owner: str


def encode_data(identity: str, metadata: Mapping[str, str]) -> bytes:
    """The data of a contender node."""
    if not metadata:
        return _bare_data(identity)  # most locks publish none: the same bytes each time
    return json.dumps({"i": identity, "m": dict(metadata)}, ensure_ascii=False).encode()


@functools.lru_cache(maxsize=256)
def _bare_data(identity: str) -> bytes:
    return json.dumps({"i": identity, "m": {}}, ensure_ascii=False).encode()


def decode_data(data: bytes | None) -> tuple[str, dict[str, str]]:
    """``(identity, metadata)`` of a contender node's data.

    :raises ValueError: it is not data aiolease writes
    """
    record = json.loads((data or b"").decode())
    if not isinstance(record, dict) or set(record) != {"i", "m"}:
        raise ValueError("not a JSON object of keys i and m")
    identity, metadata = record["i"], record["m"]
    if not isinstance(identity, str) or not isinstance(metadata, dict):
        raise ValueError("identity or metadata of the wrong type")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("metadata is not a str -> str map")
    return identity, metadata


class Layout:
    """Paths under one base node.

    :param base: ``<chroot>/<prefix>``, absolute, without a trailing ``/``
    """

    def __init__(self, base: str) -> None:
        self.base = base

    def name_node(self, name: str) -> str:
        """The container node of ``name``."""
        return f"{self.base}/{_quote(name)}"

    def new_node(self, name: str, owner: str) -> str:
        """The path to create ``owner``'s sequential contender node of ``name`` at."""
        return f"{self.name_node(name)}/{self.owner_head(owner)}"

    @staticmethod
    def owner_head(owner: str) -> str:
        """How every contender node of ``owner`` starts."""
        return f"{_HEAD}{_quote(owner)}{_MARK}"

    def path(self, name: str, node: str) -> str:
        """The full path of the child ``node`` of ``name``'s node."""
        return f"{self.name_node(name)}/{node}"

    @staticmethod
    def contender(name: str, node: str) -> Contender:
        """What the child ``node`` of ``name``'s node stands for.

        :raises ForeignDataError: it is not a node aiolease creates
        """
        head, mark, digits = node.rpartition(_MARK)
        if (
            not mark
            or not head.startswith(_HEAD)
            or len(digits) != _DIGITS
            or not digits.isdigit()
            or _quote(unquote(head[len(_HEAD) :])) != head[len(_HEAD) :]
        ):
            raise foreign(name, node, "its name is not one aiolease gives its nodes")
        return Contender(int(digits), node, unquote(head[len(_HEAD) :]))

    def queue(self, name: str, children: Iterable[str]) -> list[Contender]:
        """The contenders of ``name`` in queue order (the first holds).

        :raises ForeignDataError: a child is not aiolease's
        """
        return sorted(self.contender(name, child) for child in children)

    @staticmethod
    def holder(
        name: str, contender: Contender, data: bytes | None, token: int, remaining: float | None
    ) -> HolderInfo:
        """The :class:`HolderInfo` of the first contender of ``name``.

        :raises ForeignDataError: its data is not aiolease's
        """
        try:
            identity, metadata = decode_data(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise foreign(name, contender.node, f"its data is not aiolease's ({exc})") from None
        return HolderInfo(name, contender.owner, identity, token, metadata, remaining)


def foreign(name: str, node: str, why: str) -> ForeignDataError:
    """The error for a node under ``name``'s node that aiolease did not write."""
    return ForeignDataError(
        f"ZooKeeper node {node!r} of lease {name!r}: {why}; it was left unchanged, and"
        " nothing is granted over it: another program seems to write under this backend's"
        " prefix; give aiolease another prefix",
        name=name,
    )
