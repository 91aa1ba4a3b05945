"""PostgreSQL URLs: asyncpg's DSN, and the options that are aiolease's own.

See :meth:`aiolease.backends.postgres.PostgresBackend.from_url` for the options.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode, urlunsplit

from ..._exceptions import InvalidArgument
from ..._urls import redact, scrub, split_url
from ..sql._options import parse_bool, parse_count, parse_query, parse_seconds, parse_size

__all__ = ["KEYWORD_ONLY", "URL_OPTIONS", "parse_pooler", "parse_url"]

#: What ``pooler`` may say: ``none`` and ``session`` (a session-mode pool) change nothing.
_POOLERS = ("none", "session", "transaction")


def parse_pooler(value: object) -> str:
    """:raises InvalidArgument: unless ``value`` is one of :data:`_POOLERS`"""
    if not isinstance(value, str) or value.strip().lower() not in _POOLERS:
        raise InvalidArgument(f"pooler must be one of {', '.join(_POOLERS)}; got {value!r}")
    return value.strip().lower()


URL_OPTIONS: dict[str, Callable[[str], Any]] = {
    "table": str,
    "schema": str,
    "channel": str,
    "listen": parse_bool,
    "listen_url": str,
    "poll_interval": parse_seconds,
    "renew_window": parse_seconds,
    "command_timeout": parse_seconds,
    "connect_timeout": parse_seconds,
    "min_size": parse_size,
    "max_size": parse_count,
    "statement_cache_size": parse_size,
    "pooler": parse_pooler,
}
KEYWORD_ONLY = ("connect_options",)


def parse_url(url: str) -> tuple[str, dict[str, Any]]:
    """Split a PostgreSQL URL into asyncpg's DSN and our options.

    :raises InvalidArgument: not a postgres(ql) URL, or a bad option
    """
    parts = split_url(url, "PostgreSQL")
    if parts.scheme.lower() not in ("postgres", "postgresql") or parts.fragment:
        raise InvalidArgument(
            f"a PostgreSQL URL is 'postgresql://user@host:5432/dbname', got {redact(url)!r}"
        )
    ours, rest = parse_query(parts.query, URL_OPTIONS, what="PostgreSQL", keep_unknown=True)
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as exc:
        raise InvalidArgument(scrub(f"PostgreSQL URL {redact(url)!r}: {exc}", url)) from None
    dsn = urlunsplit(parts._replace(scheme="postgresql", query=urlencode(rest)))
    return dsn, ours
