"""The backend's own packing of ZooKeeper requests and parsing of their replies
(``_codec``) against aiozk's: byte for byte the same requests, the same fields read
from the same replies. (The conformance suite runs them against the real server.)"""

from __future__ import annotations

import struct
from typing import Any

import pytest
from aiozk import protocol
from aiozk.protocol.stat import Stat

from aiolease.backends.zookeeper import _codec as codec

PATH = "/aiolease/n%2Fü/_c_permit%3Aab-p3x1-"


def _aiozk_create(data: bytes, sequence: bool, ephemeral: bool, container: bool) -> Any:
    request = protocol.Create2Request(path=PATH, data=data, acl=[protocol.UNRESTRICTED_ACCESS])
    request.set_flags(ephemeral, sequence, container)
    return request


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (
            codec.create(PATH, b'{"i":"h"}', sequence=True, ephemeral=True, container=False),
            _aiozk_create(b'{"i":"h"}', True, True, False),
        ),
        (
            codec.create(PATH, b"", sequence=False, ephemeral=False, container=True),
            _aiozk_create(b"", False, False, True),
        ),
        (codec.children(PATH), protocol.GetChildren2Request(path=PATH, watch=False)),
        (codec.children(PATH, True), protocol.GetChildren2Request(path=PATH, watch=True)),
        (codec.get(PATH), protocol.GetDataRequest(path=PATH, watch=False)),
        (codec.exists(PATH, True), protocol.ExistsRequest(path=PATH, watch=True)),
        (codec.set_data(PATH, b"x"), protocol.SetDataRequest(path=PATH, data=b"x", version=-1)),
        (codec.delete(PATH), protocol.DeleteRequest(path=PATH, version=-1)),
    ],
)
def test_requests_are_aiozks_byte_for_byte(ours: codec.Request, theirs: Any) -> None:
    assert ours.opcode == theirs.opcode
    assert ours.serialize(7) == theirs.serialize(7)


STAT = (1 << 40, (1 << 40) + 5, 1700000000000, 1700000000001, 2, 3, 0, 0x1234, 9, 2, 77)


def _stat() -> bytes:
    return struct.pack("!qqqqiiiqiiq", *STAT)


def _string(text: bytes) -> bytes:
    return struct.pack("!i", len(text)) + text


@pytest.mark.parametrize(
    ("opcode", "body", "fields"),
    [
        (15, _string(PATH.encode() + b"0000000001") + _stat(), ("path", "stat")),
        (
            12,
            struct.pack("!i", 2) + _string(b"a") + _string("ü".encode()) + _stat(),
            ("children", "stat"),
        ),
        (12, struct.pack("!i", 0) + _stat(), ("children", "stat")),
        (4, _string(b"data") + _stat(), ("data", "stat")),
        (4, struct.pack("!i", -1) + _stat(), ("data", "stat")),
        (3, _stat(), ("stat",)),
        (5, _stat(), ("stat",)),
    ],
)
def test_replies_read_as_aiozk_reads_them(
    opcode: int, body: bytes, fields: tuple[str, ...]
) -> None:
    ours = codec.PARSERS[opcode](body)
    theirs = protocol.response_xref[opcode].deserialize(body)
    for field in fields:
        mine, its = getattr(ours, field), getattr(theirs, field)
        if field == "stat":
            for name in Stat.parts:
                assert getattr(mine, name[0]) == getattr(its, name[0]), name[0]
        else:
            assert mine == its, field
