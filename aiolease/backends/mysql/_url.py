"""The URL of the MySQL / MariaDB backend: asyncmy's connect arguments and our options."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from ..._exceptions import InvalidArgument
from ..._urls import redact, scrub, split_url
from ..sql._options import parse_count, parse_query, parse_seconds, parse_size

__all__ = ["KEYWORD_ONLY", "URL_OPTIONS", "parse_url"]

URL_OPTIONS: dict[str, Callable[[str], Any]] = {
    "table": str,
    "poll_interval": parse_seconds,
    "renew_window": parse_seconds,
    "connect_timeout": parse_seconds,
    "min_size": parse_size,
    "max_size": parse_count,
}
KEYWORD_ONLY = ("connect_options",)


def parse_url(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a MySQL URL into asyncmy's connect arguments and our options.

    :raises InvalidArgument: not a mysql/mariadb URL, no database, or a bad option
    """
    parts = split_url(url, "MySQL")
    usage = "a MySQL URL is 'mysql://user:password@host:3306/database'"
    if parts.scheme.lower() not in ("mysql", "mariadb") or parts.fragment:
        raise InvalidArgument(f"{usage}, got {redact(url)!r}")
    database = unquote(parts.path[1:]) if parts.path.startswith("/") else ""
    if not database or "/" in database:
        raise InvalidArgument(f"{usage}: {redact(url)!r} names no database")
    try:
        port = parts.port or 3306
    except ValueError as exc:
        raise InvalidArgument(scrub(f"{usage}: {redact(url)!r}: {exc}", url)) from None
    ours, _ = parse_query(parts.query, URL_OPTIONS, what="MySQL", keep_unknown=False)
    connect: dict[str, Any] = {
        "host": parts.hostname or "127.0.0.1",
        "port": port,
        "user": unquote(parts.username) if parts.username else "root",
        "password": unquote(parts.password) if parts.password else "",
        "database": database,
        "autocommit": True,
        "charset": "utf8mb4",
    }
    return connect, ours
