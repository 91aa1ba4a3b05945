"""Lease rows of the SQL backends, read back: a holder, or a :class:`ForeignDataError`.

A row that aiolease wrote for a held lease has an owner id (non-empty UTF-8 text),
an identity (UTF-8 text), a token (an integer >= 1), metadata (a JSON object of
strings; none counts as ``{}``) and an expiry. A row with anything else was written
by another program, or damaged: it is reported as a :class:`ForeignDataError` that
names the table and the row, never as a driver's or ``json``'s exception, and the
statements never grant over it (see each backend). The same checks serve
PostgreSQL, MySQL / MariaDB and SQLite. No driver is imported here.
"""

from __future__ import annotations

import json

from ..._exceptions import ForeignDataError
from ...abc import HolderInfo

__all__ = ["HOLDER_COLUMNS", "check_token", "decode_metadata", "foreign", "row_holder"]

#: The columns a holder is read from, in the order :func:`row_holder` takes them.
HOLDER_COLUMNS = ("owner", "identity", "token", "metadata", "remaining")


def foreign(table: str, name: str, problem: str) -> ForeignDataError:
    """The error for row ``name`` of ``table`` (as messages name it), which has ``problem``."""
    return ForeignDataError(
        f"row {name!r} of table {table} was not written by aiolease ({problem}); it was"
        " left unchanged, and nothing is granted over it: another program seems to write"
        " to this table; give aiolease a table of its own",
        name=name,
    )


def _text(what: str, value: object) -> str:
    """A text column (``bytes`` from a binary column must be UTF-8).

    :raises ValueError: anything else
    """
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"its {what} is not UTF-8: {value!r}") from None
    if isinstance(value, str):
        return value
    raise ValueError(f"its {what} is {value!r}")


def _token(value: object) -> int:
    """:raises ValueError: unless ``value`` is an integer >= 1"""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"its token is {value!r}, not an integer >= 1")
    return value


def check_token(table: str, name: str, token: object) -> int:
    """The token of row ``name``, free or held: a token that is not an integer would
    make the next grant's restart (fencing tokens must only grow).

    :raises ForeignDataError: it is not an integer >= 1
    """
    try:
        return _token(token)
    except ValueError as exc:
        raise foreign(table, name, str(exc)) from None


def decode_metadata(text: object) -> dict[str, str]:
    """The metadata of a stored row (``{}`` for none).

    :raises ValueError: it is not a JSON object of strings
    """
    if text is None or text in ("", b""):
        return {}
    raw = _text("metadata", text)
    try:
        loaded = json.loads(raw)
    except ValueError:
        loaded = None
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in loaded.items()
    ):
        raise ValueError(f"its metadata is not a JSON object of strings: {raw[:80]!r}")
    return loaded


def _seconds(value: object, unit: float, since: float) -> float:
    """``value * unit - since``, at least 0.

    :raises ValueError: ``value`` is not a number (``None``: the row never expires)
    """
    if value is None:
        raise ValueError("it is held with no expiry")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"its expiry is {value!r}")
    return max(value * unit - since, 0.0)


def row_holder(
    table: str,
    name: str,
    owner: object,
    identity: object,
    token: object,
    metadata: object,
    left: object,
    *,
    unit: float = 1.0,
    since: float = 0.0,
) -> HolderInfo:
    """The holder that a held row's values stand for.

    :param table: the table, as messages name it
    :param left: the row's expiry: ``left * unit - since`` is the seconds it has left
        (clamped at 0); ``None`` for a row held with no expiry
    :raises ForeignDataError: a value aiolease would not have written
    """
    try:
        who = _text("owner", owner)
        if not who:
            raise ValueError("its owner is empty")
        return HolderInfo(
            name,
            who,
            _text("identity", identity),
            _token(token),
            decode_metadata(metadata),
            _seconds(left, unit, since),
        )
    except ValueError as exc:
        raise foreign(table, name, str(exc)) from None
