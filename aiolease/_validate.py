"""Checks at the public boundary: bad input raises :class:`InvalidArgument`, nothing is sent."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from ._exceptions import InvalidArgument

MAX_NAME_BYTES = 255
MAX_IDENTITY_BYTES = 255
MAX_METADATA_BYTES = 4096
#: The longest ttl, in seconds (365 days), on every backend. Each could store more
#: (the tightest, MySQL's ``DATETIME``, ends in the year 9999; etcd's lease ttl at
#: 9e9 s), but a lease that outlives a crashed holder by more than a year is no
#: lease; one cap for all keeps a lock portable between backends.
MAX_TTL = 365 * 24 * 3600.0


def check_name(name: object) -> str:
    """:raises InvalidArgument: unless ``name`` is a non-empty str of <= 255 UTF-8 bytes, no NUL"""
    if not isinstance(name, str):
        raise InvalidArgument(f"lease name must be a str, not {type(name).__name__}")
    return _check_text("lease name", name, MAX_NAME_BYTES, allow_empty=False)


def check_identity(identity: object) -> str:
    """:raises InvalidArgument: unless ``identity`` is a str of at most 255 UTF-8 bytes, no NUL"""
    if not isinstance(identity, str):
        raise InvalidArgument(f"identity must be a str, not {type(identity).__name__}")
    return _check_text("identity", identity, MAX_IDENTITY_BYTES, allow_empty=False)


def _check_text(what: str, value: str, limit: int, *, allow_empty: bool) -> str:
    if not value and not allow_empty:
        raise InvalidArgument(f"{what} must not be empty")
    if "\x00" in value:
        raise InvalidArgument(f"{what} must not contain NUL")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{what} is not valid UTF-8 text: {exc}") from None
    if size > limit:
        raise InvalidArgument(f"{what} is {size} bytes of UTF-8; the limit is {limit}")
    return value


def check_metadata(metadata: object) -> dict[str, str]:
    """:raises InvalidArgument: unless ``metadata`` maps str to str in at most 4 KiB of JSON"""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidArgument(f"metadata must be a mapping, not {type(metadata).__name__}")
    out: dict[str, str] = {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidArgument("metadata keys and values must be str")
        out[_check_text("metadata key", key, MAX_METADATA_BYTES, allow_empty=True)] = _check_text(
            "metadata value", value, MAX_METADATA_BYTES, allow_empty=True
        )
    size = len(json.dumps(out, ensure_ascii=False).encode("utf-8"))
    if size > MAX_METADATA_BYTES:
        raise InvalidArgument(
            f"metadata is {size} bytes as JSON; the limit is {MAX_METADATA_BYTES}"
        )
    return out


def check_seconds(what: str, value: object, *, allow_zero: bool = False) -> float:
    """:raises InvalidArgument: unless ``value`` is a finite positive number of seconds"""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{what} must be a number of seconds, not {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidArgument(f"{what} must be finite and {bound}, got {value!r}")
    return seconds


def check_ttl(value: object) -> float:
    """:raises InvalidArgument: unless ``value`` is a number of seconds in (0, :data:`MAX_TTL`]"""
    seconds = check_seconds("ttl", value)
    if seconds > MAX_TTL:
        raise InvalidArgument(f"ttl must be at most {MAX_TTL:g} seconds (365 days), got {value!r}")
    return seconds


def check_count(what: str, value: object) -> int:
    """:raises InvalidArgument: unless ``value`` is an int >= 1"""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"{what} must be an int >= 1, got {value!r}")
    return value
