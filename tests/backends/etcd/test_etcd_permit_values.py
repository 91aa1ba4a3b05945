"""Parsing a name's permit keys (``_permit_values.parse_permits``): each key version
is parsed once and remembered, and whatever the value says is what is answered."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from aetcd import rpc

from aiolease import ForeignDataError
from aiolease.backends.etcd._permit_values import encode_permit, parse_permits

START = b"prefix/%permits/name/"


@dataclass
class _Kv:
    key: bytes
    value: bytes
    create_revision: int
    lease: int


def _kv(owner: str, token: int, *, weight: int = 1, identity: str = "me") -> _Kv:
    value = encode_permit(identity, {"k": "v"}, 4, weight, False)
    return _Kv(START + owner.encode(), value, token, 7)


def test_keys_read_again_are_answered_from_memory() -> None:
    first = parse_permits("name", START, [_kv("permit:b", 9), _kv("permit:a", 5)])
    again = parse_permits("name", START, [_kv("permit:a", 5), _kv("permit:b", 9)])
    assert [k.owner for k in first] == ["permit:a", "permit:b"]  # oldest first
    assert [k.token for k in first] == [5, 9]
    assert all(a is b for a, b in zip(first, again, strict=True))


def test_a_key_whose_value_changed_is_parsed_anew() -> None:
    (old,) = parse_permits("name", START, [_kv("permit:c", 11, weight=1)])
    (new,) = parse_permits("name", START, [_kv("permit:c", 11, weight=2, identity="you")])
    assert (old.weight, old.identity) == (1, "me")
    assert (new.weight, new.identity) == (2, "you")


def test_a_foreign_value_is_refused_every_time() -> None:
    foreign = _Kv(START + b"permit:d", b"not json", 13, 7)
    for _ in range(2):  # a refusal is not remembered as an answer
        with pytest.raises(ForeignDataError, match="did not write"):
            parse_permits("name", START, [foreign])


def test_the_real_key_values_parse_as_the_stand_ins() -> None:
    value = encode_permit("me", {"k": "v"}, 4, 1, False)
    real = rpc.KeyValue(key=START + b"permit:e", value=value, create_revision=17, lease=7)
    (key,) = parse_permits("name", START, [real])
    assert (key.owner, key.token, key.lease, key.limit, key.metadata) == (
        "permit:e",
        17,
        7,
        4,
        {"k": "v"},
    )


def test_a_key_in_a_slot_is_its_value_s_owner_s() -> None:
    """A request's keys are in a slot of the backend's; the value names the owner."""
    owner = "permit:" + "ab" * 16
    held = encode_permit("me", {}, 4, 1, False, owner)
    queued = encode_permit("me", {}, 4, 2, True, owner)
    keys = parse_permits(
        "name",
        START,
        [
            _Kv(START + b"permit:0123456789abcdef.7", held, 21, 7),
            _Kv(START + b"permit:qpermit:0123456789abcdef.8", queued, 23, 7),
        ],
    )
    assert [(k.owner, k.slot, k.permit_slot, k.queued) for k in keys] == [
        (owner, "permit:0123456789abcdef.7", "permit:0123456789abcdef.7", False),
        (owner, "permit:qpermit:0123456789abcdef.8", "permit:0123456789abcdef.8", True),
    ]


def test_a_key_of_the_older_layout_is_its_slot_s_owner_s() -> None:
    """Written by an older version: the owner id is the slot, the value has no owner."""
    owner = "permit:" + "cd" * 16
    value = encode_permit("them", {}, 4, 1, True)
    (key,) = parse_permits("name", START, [_Kv(START + f"permit:q{owner}".encode(), value, 25, 7)])
    assert (key.owner, key.queued, key.permit_slot) == (owner, True, owner)


@pytest.mark.parametrize("owner", ["lock-owner", 5, "", None])
def test_a_value_that_names_no_permit_owner_is_foreign(owner: object) -> None:
    value = encode_permit("me", {}, 4, 1, False)
    named = b'{"owner":' + json.dumps(owner).encode() + b"," + value[1:]
    with pytest.raises(ForeignDataError, match="did not write"):
        parse_permits("name", START, [_Kv(START + b"permit:0123456789abcdef.1", named, 27, 7)])
