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
from typing import Any, NamedTuple

__all__ = [
    "PARSERS",
    "Request",
    "Stat",
    "children",
    "create",
    "delete",
    "exists",
    "get",
    "multi",
    "set_data",
]

_INT = struct.Struct("!i")
_HEADER = struct.Struct("!ii")  # xid, opcode
_STAT = struct.Struct("!qqqqiiiqiiq")
_EPHEMERAL, _SEQUENTIAL, _CONTAINER = 1, 2, 4
_MULTI_HEADER = struct.Struct("!i?i")  # type, done, error
_MULTI_END = _MULTI_HEADER.pack(-1, True, -1)


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

    __slots__ = ("opcode", "payload", "target", "then")
    special_xid = None

    def __init__(self, opcode: int, payload: bytes, target: str | None = None) -> None:
        self.opcode = opcode
        self.payload = payload
        #: The path a delete removes (``None`` for the other requests).
        self.target = target
        #: Called with the reply's future once it is done (answered, or failed): the
        #: callbacks of a session's requests run in the order the server applied them.
        self.then: Callable[[Any], None] | None = None

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


def multi(*requests: Request) -> Request:
    """``Multi``: ``requests`` (deletes, ``SetData``) applied all or none, in one
    transaction (one zxid)."""
    parts = [_MULTI_HEADER.pack(r.opcode, False, -1) + r.payload for r in requests]
    return Request(14, b"".join(parts) + _MULTI_END)


class Stat(NamedTuple):
    """A node's stat, with aiozk's attribute names (a named tuple: made in C, a few
    times cheaper than a frozen dataclass; several replies carry one per acquire)."""

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


class Reply(NamedTuple):
    """A reply, with aiozk's attribute names (those the request has)."""

    stat: Stat | None = None
    path: str = ""
    children: list[str] | None = None
    data: bytes | None = None
    #: The results of a ``Multi``'s requests, in order (an error code as an ``int``).
    results: list[Any] | None = None


def _read_string(body: bytes, at: int) -> tuple[bytes | None, int]:
    (size,) = _INT.unpack_from(body, at)
    at += 4
    if size < 0:
        return None, at
    return body[at : at + size], at + size


def _stat(body: bytes, at: int) -> Stat:
    return Stat._make(_STAT.unpack_from(body, at))


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


def _multi(body: bytes) -> Reply:
    results: list[Any] = []
    kind, done, _ = _MULTI_HEADER.unpack_from(body, 0)
    at = _MULTI_HEADER.size
    while not done:
        if kind == -1:
            (code,) = _INT.unpack_from(body, at)
            results.append(code)
            at += 4
        elif kind == 5:
            results.append(Reply(stat=_stat(body, at)))
            at += _STAT.size
        elif kind in (2, 13):  # delete, check
            results.append(Reply())
        elif kind == 1:  # create (Create2 answers with the same)
            path, at = _read_string(body, at)
            results.append(Reply(path=(path or b"").decode()))
        else:
            raise ValueError(f"a Multi result of type {kind}")
        kind, done, _ = _MULTI_HEADER.unpack_from(body, at)
        at += _MULTI_HEADER.size
    return Reply(results=results)


#: Reply parsers by the opcode of their request (the others are aiozk's).
PARSERS: dict[int, Callable[[bytes], Any]] = {
    15: _created,
    12: _listed,
    4: _data,
    3: _stat_only,
    5: _stat_only,
    2: _empty,
    14: _multi,
}
