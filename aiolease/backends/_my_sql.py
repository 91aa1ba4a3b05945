"""The SQL text of the MySQL / MariaDB backend (no driver).

See :mod:`aiolease.backends.mysql` for what each statement guarantees.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["Prepared", "Sql"]

_NOW = "UTC_TIMESTAMP(6)"
_EXPIRY = f"{_NOW} + INTERVAL %(us)s MICROSECOND"
#: The row may be granted to the caller: free, expired, or the caller's.
_GRANTABLE = f"(owner IS NULL OR expires_at <= {_NOW} OR owner = %(owner)s)"
#: The caller already holds it, live: an idempotent retry.
_RETRY = f"(owner <=> %(owner)s AND expires_at > {_NOW})"
_MINE = "owner <=> %(owner)s"


class Prepared(NamedTuple):
    """A statement with positional ``%s`` parameters, named in ``names`` (in order).

    Positional parameters let asyncmy run it as a server-side prepared statement
    (when the connection has a statement cache): the server parses it once per
    connection, not once per call, which matters for a statement this long.
    """

    sql: str
    names: tuple[str, ...]

    @classmethod
    def of(cls, sql: str) -> Prepared:
        """From ``sql`` with ``%(name)s`` parameters (a name may repeat)."""
        return cls(_NAMED.sub("%s", sql), tuple(_NAMED.findall(sql)))


_NAMED = re.compile(r"%\((\w+)\)s")


class Sql:
    """The statements for one table (the identifier validated and quoted)."""

    def __init__(self, table: str) -> None:
        t = f"`{table}`"
        self.create = (
            f"CREATE TABLE IF NOT EXISTS {t} ("
            " name VARBINARY(255) NOT NULL PRIMARY KEY, token BIGINT UNSIGNED NOT NULL,"
            " owner VARBINARY(255) NULL, identity VARBINARY(1024) NULL, metadata BLOB NULL,"
            " ttl DOUBLE NULL, acquired_at DATETIME(6) NULL, expires_at DATETIME(6) NULL"
            ") ENGINE=InnoDB"
        )
        # Assignment order matters: token, acquired_at, identity and metadata read the
        # untouched row (a retry keeps them), owner is decided next, and the rest follow
        # the new owner.
        self.acquire = Prepared.of(
            f"INSERT INTO {t} (name, token, owner, identity, metadata, ttl, acquired_at,"
            " expires_at) VALUES (%(name)s, LAST_INSERT_ID(1), %(owner)s, %(identity)s,"
            f" %(metadata)s, %(ttl)s, {_NOW}, {_EXPIRY})"
            " ON DUPLICATE KEY UPDATE"
            f" token = IF({_GRANTABLE}, LAST_INSERT_ID(IF({_RETRY}, token, token + 1)),"
            " token + LAST_INSERT_ID(0)),"
            f" acquired_at = IF({_GRANTABLE} AND NOT {_RETRY}, {_NOW}, acquired_at),"
            f" identity = IF({_GRANTABLE} AND NOT {_RETRY}, %(identity)s, identity),"
            f" metadata = IF({_GRANTABLE} AND NOT {_RETRY}, %(metadata)s, metadata),"
            f" owner = IF({_GRANTABLE}, %(owner)s, owner),"
            f" ttl = IF({_MINE}, %(ttl)s, ttl),"
            f" expires_at = IF({_MINE}, {_EXPIRY}, expires_at)"
        )
        self.holder = Prepared.of(
            "SELECT owner, identity, token, metadata,"
            f" TIMESTAMPDIFF(MICROSECOND, {_NOW}, expires_at) FROM {t}"
            f" WHERE name = %(name)s AND owner IS NOT NULL AND expires_at > {_NOW}"
        )
        self.renew = (
            f"UPDATE {t} SET token = LAST_INSERT_ID(token), ttl = %(ttl)s,"
            f" expires_at = {_EXPIRY} WHERE name = %(name)s AND owner = %(owner)s"
            f" AND token = %(token)s AND expires_at > {_NOW}"
        )
        self.release = Prepared.of(
            f"UPDATE {t} SET token = LAST_INSERT_ID(token), owner = NULL, identity = NULL,"
            " metadata = NULL, expires_at = NULL WHERE name = %(name)s AND owner = %(owner)s"
            f" AND (%(token)s IS NULL OR token = %(token)s) AND expires_at > {_NOW}"
        )
        # Release and grant to the next holder in one statement (WHERE reads the old row;
        # the token is assigned first, so LAST_INSERT_ID carries the new one back).
        self.hand_off = Prepared.of(
            f"UPDATE {t} SET token = LAST_INSERT_ID(token + 1), owner = %(next)s,"
            " identity = %(identity)s, metadata = %(metadata)s, ttl = %(ttl)s,"
            f" acquired_at = {_NOW}, expires_at = {_EXPIRY}"
            " WHERE name = %(name)s AND owner = %(owner)s"
            f" AND (%(token)s IS NULL OR token = %(token)s) AND expires_at > {_NOW}"
        )
        self._table = t

    def renew_many(self, count: int) -> str:
        """Renew ``count`` leases of one ttl: params ttl, microseconds, then a
        (name, owner, token) triple per lease."""
        return (
            f"UPDATE {self._table} SET ttl = %s, expires_at = {_NOW} + INTERVAL %s MICROSECOND"
            f" WHERE (name, owner, token) IN ({_triples(count)}) AND expires_at > {_NOW}"
        )

    def renew_mixed(self, count: int) -> str:
        """Renew ``count`` leases of different ttls: params (name, owner, token, ttl,
        microseconds) per lease."""
        rows = " UNION ALL SELECT %s, %s, %s, %s, %s" * (count - 1)
        return (
            f"UPDATE {self._table} AS l JOIN (SELECT %s AS name, %s AS owner, %s AS token,"
            f" %s AS ttl, %s AS us{rows}) AS v"
            " ON l.name = v.name AND l.owner = v.owner AND l.token = v.token"
            f" SET l.ttl = v.ttl, l.expires_at = {_NOW} + INTERVAL v.us MICROSECOND"
            f" WHERE l.expires_at > {_NOW}"
        )

    def live(self, count: int) -> str:
        """Which of ``count`` (name, owner, token) triples hold a live row."""
        return (
            f"SELECT name, owner, token FROM {self._table}"
            f" WHERE (name, owner, token) IN ({_triples(count)}) AND expires_at > {_NOW}"
        )


def _triples(count: int) -> str:
    return ", ".join(["(%s, %s, %s)"] * count)
