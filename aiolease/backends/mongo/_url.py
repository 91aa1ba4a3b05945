"""``mongodb://`` and ``mongodb+srv://`` URLs: pymongo's, and the options that are ours.

::

    mongodb://[user[:password]@]host[:port][,host[:port]...][/database][?option=value&...]

Our options (in the query, or as keyword arguments to ``from_url``, not both):
``database`` (default: the URL's path, else ``aiolease``), ``collection``
(default ``aiolease_leases``), ``fair``, ``watch``, ``poll_interval``, ``w`` and
``wtimeout`` (seconds). Every other query option goes to pymongo, which checks it.
Database and collection names are validated (:func:`check_database`,
:func:`check_collection`); a password never shows in an error or a repr.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlencode, urlunsplit

from ..._exceptions import InvalidArgument
from ..._urls import redact, scrub, split_url
from ..._validate import check_seconds
from ..sql._options import parse_bool, parse_query, parse_seconds

__all__ = [
    "DEFAULT_COLLECTION",
    "DEFAULT_DATABASE",
    "MongoUrl",
    "check_collection",
    "check_database",
    "check_w",
    "parse_url",
]

DEFAULT_DATABASE = "aiolease"
DEFAULT_COLLECTION = "aiolease_leases"

#: A database name: letters, digits, ``_`` and ``-`` (none of MongoDB's forbidden
#: ``/\. "$*<>:|?``), at most 63 bytes.
_DATABASE_RE = re.compile(r"[A-Za-z0-9_-]{1,63}")
#: A collection name: a letter or ``_`` first, then letters, digits, ``_``, ``-`` and
#: single inner dots (no ``$``, no NUL, not ``system.``), at most 120 bytes.
_COLLECTION_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_-]+)*")
_COLLECTION_MAX = 120


def check_database(value: object) -> str:
    """:raises InvalidArgument: not a plain database name"""
    if not isinstance(value, str) or not _DATABASE_RE.fullmatch(value):
        raise InvalidArgument(
            f"database must be 1-63 ASCII letters, digits, '_' or '-', got {value!r}"[:200]
        )
    return value


def check_collection(value: object) -> str:
    """:raises InvalidArgument: not a plain collection name"""
    if (
        not isinstance(value, str)
        or len(value) > _COLLECTION_MAX
        or not _COLLECTION_RE.fullmatch(value)
        or value.startswith("system.")
    ):
        raise InvalidArgument(
            "collection must be ASCII letters, digits, '_', '-' and inner dots, starting"
            f" with a letter or '_', not 'system.', at most {_COLLECTION_MAX} characters;"
            f" got {value!r}"[:300]
        )
    return value


def check_w(value: object) -> int | str:
    """A write concern's ``w``: ``majority``, a tag set name, or a count >= 0.

    :raises InvalidArgument: anything else
    """
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgument(f"w must be 'majority' or a number of members, got {value!r}")
    if isinstance(value, int) and value < 0:
        raise InvalidArgument(f"w must be >= 0, got {value!r}")
    if isinstance(value, str) and not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,63}", value):
        raise InvalidArgument(f"w must be 'majority' or a number of members, got {value!r}")
    return value


def _positive_seconds(value: str) -> float:
    return check_seconds("option", float(value))


#: Our options, each with the parser of its text in a URL.
URL_OPTIONS: dict[str, Callable[[str], Any]] = {
    "database": check_database,
    "collection": check_collection,
    "fair": parse_bool,
    "watch": parse_bool,
    "poll_interval": _positive_seconds,
    "w": check_w,
    "wtimeout": parse_seconds,
}


#: The keyword options checked here (the others by the backend's constructor).
_KEYWORD_CHECKS: dict[str, Callable[[object], Any]] = {
    "database": check_database,
    "collection": check_collection,
    "w": check_w,
}


@dataclass(frozen=True)
class MongoUrl:
    """A parsed MongoDB URL.

    :param client_url: what pymongo gets: the URL without our options (it holds the
        password: never shown)
    :param database: the database of the leases
    :param options: our options, from the query and the keyword arguments
    """

    client_url: str = field(repr=False)
    database: str
    options: Mapping[str, Any]


def parse_url(url: str, keywords: Mapping[str, Any]) -> MongoUrl:
    """Split ``url`` into pymongo's URL and our options (``keywords`` are ``from_url``'s).

    :raises InvalidArgument: not a MongoDB URL, a malformed or repeated option
    """
    parts = split_url(url, "MongoDB")
    if parts.scheme.lower() not in ("mongodb", "mongodb+srv") or parts.fragment:
        raise InvalidArgument(
            "a MongoDB URL is 'mongodb://user@host:27017/database?replicaSet=rs0'"
            f" (or mongodb+srv://), got {redact(url)!r}"
        )
    if not parts.netloc.rpartition("@")[2]:
        raise InvalidArgument(f"MongoDB URL {redact(url)!r} names no host")
    ours, rest = parse_query(parts.query, URL_OPTIONS, what="MongoDB", keep_unknown=True)
    for key in ("wtimeoutms", "readpreference", "readconcernlevel"):
        clash = [k for k, _ in rest if k.lower() == key]
        if clash:
            raise InvalidArgument(
                f"MongoDB URL option {clash[0]!r} is not taken: aiolease reads the primary"
                " with majority read concern, and its write concern is 'w' and 'wtimeout'"
            )
    w = [k for k, _ in rest if k.lower() == "w"]
    if w:  # pymongo's own spelling of ours, in another case
        raise InvalidArgument(f"MongoDB URL option {w[0]!r}: write it as 'w'")
    for key, value in keywords.items():
        if key not in URL_OPTIONS:
            raise InvalidArgument(
                f"unknown MongoDB option {key!r}; known: {', '.join(sorted(URL_OPTIONS))}"
            )
        if key in ours:
            raise InvalidArgument(f"MongoDB option {key!r} is given in the URL and as arguments")
        check = _KEYWORD_CHECKS.get(key)
        ours[key] = value if check is None else check(value)
    path = unquote(parts.path.lstrip("/"))
    database = ours.pop("database", None) or path or DEFAULT_DATABASE
    problem = None
    try:
        check_database(database)
    except InvalidArgument as exc:
        problem = str(exc)
    if problem is not None:  # raised outside the handler: no context to show the URL
        raise InvalidArgument(scrub(problem, url))
    client_url = urlunsplit(parts._replace(query=urlencode(rest)))
    return MongoUrl(client_url, database, ours)
