"""The SQLite backend's input at its boundary: its URL, its file and its table name,
checked before anything is opened (:class:`~aiolease.InvalidArgument` for each)."""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import parse_qsl, unquote

from .._exceptions import InvalidArgument
from .._urls import redact, split_url

__all__ = ["URL_OPTIONS", "check_path", "check_table", "parse_url"]

_TABLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_HEADER = b"SQLite format 3\x00"
#: The options a URL may give, and how each is read.
URL_OPTIONS = {"table": str, "busy_timeout": float, "poll_interval": float}


def check_table(table: object) -> str:
    """:raises InvalidArgument: unless ``table`` is a plain SQL identifier of at most 63 chars"""
    if not isinstance(table, str) or not _TABLE_RE.fullmatch(table):
        raise InvalidArgument(
            f"table name must match {_TABLE_RE.pattern} (letters, digits, _), got {table!r}"
        )
    return table


def check_path(path: object) -> str:
    """Resolve ``path`` to an absolute path of a usable database file, creating nothing.

    :raises InvalidArgument: ``path`` is a directory, its directory is missing or is
        not a directory, or the file exists and is not a SQLite database
    """
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgument(f"SQLite path must be a str or path, not {type(path).__name__}")
    raw = os.fspath(path)
    if not isinstance(raw, str) or raw in ("", ":memory:") or "\x00" in raw:
        raise InvalidArgument(
            f"SQLite path must name a file (use 'memory://' for an in-process store), got {raw!r}"
        )
    full = os.path.abspath(raw)
    parent = os.path.dirname(full)
    if os.path.isdir(full):
        raise InvalidArgument(f"SQLite path {full!r} is a directory, not a database file")
    if not os.path.exists(parent):
        raise InvalidArgument(f"SQLite path {full!r}: directory {parent!r} does not exist")
    if not os.path.isdir(parent):
        raise InvalidArgument(f"SQLite path {full!r}: {parent!r} is not a directory")
    if os.path.exists(full):
        _check_header(full)
    return full


def _check_header(path: str) -> None:
    if not os.path.isfile(path):
        raise InvalidArgument(f"SQLite path {path!r} is not a regular file")
    try:
        with open(path, "rb") as f:
            header = f.read(len(_HEADER))
    except OSError as exc:
        raise InvalidArgument(f"SQLite database {path!r} cannot be read: {exc}") from exc
    # An empty file is a valid, empty database.
    if header and header != _HEADER:
        raise InvalidArgument(f"{path!r} exists and is not a SQLite database")


def parse_url(url: str) -> tuple[str, dict[str, Any]]:
    """Split a ``sqlite:///`` URL into a path and options.

    :raises InvalidArgument: wrong scheme, a host, no path, or an unknown option
    """
    parts = split_url(url, "SQLite")
    if parts.scheme.lower() != "sqlite" or parts.netloc or parts.fragment:
        raise InvalidArgument(
            "a SQLite URL is 'sqlite:///relative.db' or 'sqlite:////absolute.db',"
            f" got {redact(url)!r}"
        )
    if not parts.path.startswith("/") or len(parts.path) < 2:
        raise InvalidArgument(f"SQLite URL {redact(url)!r} names no file")
    options: dict[str, Any] = {}
    try:
        query = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as exc:
        raise InvalidArgument(f"SQLite URL {redact(url)!r} has a malformed query: {exc}") from None
    for key, value in query:
        convert = URL_OPTIONS.get(key)
        if convert is None or key in options:
            known = ", ".join(URL_OPTIONS)
            raise InvalidArgument(
                f"SQLite URL option {key!r} is unknown or repeated (known: {known})"
            )
        try:
            options[key] = convert(value)
        except ValueError:
            raise InvalidArgument(f"SQLite URL option {key}={value!r} is malformed") from None
    return unquote(parts.path[1:]), options
