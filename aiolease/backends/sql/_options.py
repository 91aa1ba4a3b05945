"""URL options of the SQL backends, and their pool sizes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl

from ..._exceptions import InvalidArgument
from ..._validate import check_count, check_seconds

__all__ = [
    "parse_bool",
    "parse_count",
    "parse_query",
    "parse_seconds",
    "parse_size",
    "pool_size",
]


def parse_bool(value: str) -> bool:
    """``true/false``, ``yes/no``, ``on/off``, ``1/0`` (any case).

    :raises ValueError: anything else
    """
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def parse_seconds(value: str) -> float:
    """A URL option in seconds (finite, >= 0).

    :raises InvalidArgument: anything else
    """
    return check_seconds("option", float(value), allow_zero=True)


def parse_count(value: str) -> int:
    """A URL option that counts (an int >= 1).

    :raises InvalidArgument: anything else
    """
    return check_count("option", int(value))


def parse_size(value: str) -> int:
    """A URL option that may be zero (an int >= 0).

    :raises InvalidArgument: anything else
    """
    number = int(value)
    if number < 0:
        raise InvalidArgument(f"expected an int >= 0, got {value!r}")
    return number


def parse_query(
    query: str, known: Mapping[str, Callable[[str], Any]], *, what: str, keep_unknown: bool
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Split a URL query into our options (converted) and the rest.

    :param known: option name -> its parser (:func:`parse_bool`, :func:`parse_seconds`, ...)
    :param keep_unknown: return unknown options (for the driver) instead of rejecting them
    :raises InvalidArgument: a malformed query, a repeated or (unless kept) unknown
        option, or a value that does not parse
    """
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise InvalidArgument(f"{what} URL has a malformed query: {exc}") from None
    ours: dict[str, Any] = {}
    rest: list[tuple[str, str]] = []
    for key, value in pairs:
        convert = known.get(key)
        if convert is None:
            if not keep_unknown:
                raise InvalidArgument(
                    f"unknown {what} URL option {key!r}; known: {', '.join(sorted(known))}"
                )
            rest.append((key, value))
            continue
        if key in ours:
            raise InvalidArgument(f"{what} URL option {key!r} is given twice")
        try:
            ours[key] = convert(value)
        except (ValueError, InvalidArgument):
            raise InvalidArgument(f"{what} URL option {key}={value!r} is malformed") from None
    return ours, rest


def pool_size(min_size: object, max_size: object) -> tuple[int, int]:
    """:raises InvalidArgument: unless ``0 <= min_size <= max_size`` and ``max_size >= 1``"""
    for what, value in (("min_size", min_size), ("max_size", max_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgument(f"{what} must be an int >= 0, got {value!r}")
    assert isinstance(min_size, int) and isinstance(max_size, int)
    if max_size < max(min_size, 1):
        raise InvalidArgument(f"max_size ({max_size}) must be >= 1 and >= min_size ({min_size})")
    return min_size, max_size
