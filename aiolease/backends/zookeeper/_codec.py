"""ZooKeeper's wire format for the few requests the backend sends, and their replies,
packed and parsed with :mod:`struct` in one call each.

aiozk renders and parses every request and reply through a generic tree of parts (a
few dozen Python calls per message); an acquire and a release send three requests
and read three replies, so that this was a good share of the backend's own time.
The messages here are byte for byte aiozk's (``tests/backends/zookeeper`` compares
them); replies are objects with aiozk's attribute names, so that the backend reads
them alike whether they were parsed here (its own connections, :mod:`._frames`) or by
aiozk (a client the application passed in).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PARSERS",
    "Request",
    "Stat",
    "children",
    "create",
    "delete",
    "exists",
    "get",
    "set_data",
]

_INT = struct.Struct("!i")
_HEADER = struct.Struct("!ii")  # xid, opcode
_STAT = struct.Struct("!qqqqiiiqiiq")
_EPHEMERAL, _SEQUENTIAL, _CONTAINER = 1, 2, 4


def _string(text: str) -> bytes:
    raw = text.encode()
    return _INT.pack(len(raw)) + raw


def _buffer(data: bytes) -> bytes:
    return _INT.pack(len(data)) + data


#: One ACL: every permission (31) for ``world:anyone`` (aiozk's ``UNRESTRICTED_ACCESS``).
_OPEN_ACL = _INT.pack(1) + _INT.pack(31) + _string("world") + _string("anyone")


class Request:
    """A request as aiozk's connection and our wire send it: ``opcode`` and
    ``serialize(xid)`` (the frame without its size)."""

    __slots__ = ("opcode", "payload", "target")
    special_xid = None

    def __init__(self, opcode: int, payload: bytes, target: str | None = None) -> None:
        self.opcode = opcode
        self.payload = payload
        #: The path a delete removes (``None`` for the other requests).
        self.target = target

    def serialize(self, xid: int) -> bytes:
        return _HEADER.pack(xid, self.opcode) + self.payload


def create(path: str, data: bytes, *, sequence: bool, ephemeral: bool, container: bool) -> Request:
    """``Create2`` (the reply carries the node's stat), open to everyone."""
    flags = (
        (_EPHEMERAL if ephemeral else 0)
        | (_SEQUENTIAL if sequence else 0)
        | (_CONTAINER if container else 0)
    )
    return Request(15, _string(path) + _buffer(data) + _OPEN_ACL + _INT.pack(flags))


def children(path: str, watch: bool = False) -> Request:
    """``GetChildren2``."""
    return Request(12, _string(path) + (b"\x01" if watch else b"\x00"))


def get(path: str) -> Request:
    """``GetData``, no watch."""
    return Request(4, _string(path) + b"\x00")


def exists(path: str, watch: bool = False) -> Request:
    """``Exists``."""
    return Request(3, _string(path) + (b"\x01" if watch else b"\x00"))


def set_data(path: str, data: bytes) -> Request:
    """``SetData`` of any version."""
    return Request(5, _string(path) + _buffer(data) + _INT.pack(-1))


def delete(path: str) -> Request:
    """``Delete`` of any version."""
    return Request(2, _string(path) + _INT.pack(-1), path)


@dataclass(frozen=True, slots=True)
class Stat:
    """A node's stat, with aiozk's attribute names."""

    created_zxid: int
    last_modified_zxid: int
    created: int
    modified: int
    version: int
    child_version: int
    acl_version: int
    ephemeral_owner: int
    data_length: int
    num_children: int
    last_modified_children: int


@dataclass(frozen=True, slots=True)
class Reply:
    """A reply, with aiozk's attribute names (those the request has)."""

    stat: Stat | None = None
    path: str = ""
    children: list[str] | None = None
    data: bytes | None = None


def _read_string(body: bytes, at: int) -> tuple[bytes | None, int]:
    (size,) = _INT.unpack_from(body, at)
    at += 4
    if size < 0:
        return None, at
    return body[at : at + size], at + size


def _stat(body: bytes, at: int) -> Stat:
    return Stat(*_STAT.unpack_from(body, at))


def _created(body: bytes) -> Reply:
    path, at = _read_string(body, 0)
    return Reply(stat=_stat(body, at), path=(path or b"").decode())


def _listed(body: bytes) -> Reply:
    (count,) = _INT.unpack_from(body, 0)
    at, names = 4, []
    for _ in range(count):
        name, at = _read_string(body, at)
        names.append((name or b"").decode())
    return Reply(stat=_stat(body, at), children=names)


def _data(body: bytes) -> Reply:
    data, at = _read_string(body, 0)
    return Reply(stat=_stat(body, at), data=data)


def _stat_only(body: bytes) -> Reply:
    return Reply(stat=_stat(body, 0))


def _empty(body: bytes) -> Reply:
    return Reply()


#: Reply parsers by the opcode of their request (the others are aiozk's).
PARSERS: dict[int, Callable[[bytes], Any]] = {
    15: _created,
    12: _listed,
    4: _data,
    3: _stat_only,
    5: _stat_only,
    2: _empty,
}
