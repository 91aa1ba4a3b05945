"""The SQL text of the PostgreSQL backend, and what its notifications say (no driver).

See :mod:`aiolease.backends.postgres` for what each statement guarantees.
"""

from __future__ import annotations

import hashlib

__all__ = ["Payload", "Sql", "advisory_key", "default_channel", "grants_channel", "parse_payload"]


class Sql:
    """The statements for one table (identifiers validated and quoted)."""

    def __init__(self, schema: str, table: str) -> None:
        t = f'"{schema}"."{table}"'
        self.create = (
            f"CREATE TABLE IF NOT EXISTS {t} ("
            ' name text COLLATE "C" PRIMARY KEY, token bigint NOT NULL,'
            " owner text, identity text, metadata text, ttl double precision,"
            " acquired_at timestamptz, expires_at timestamptz)"
        )
        # $1 name, $2 owner, $3 identity, $4 metadata, $5 ttl, $6 channel, $7 grants
        # channel. The clock is read once (the CTE "now"); excluded.acquired_at carries it
        # into the update.
        retry = "l.owner = excluded.owner AND l.expires_at > excluded.acquired_at"
        # "held": the snapshot shows a live holder other than the caller. Then nothing
        # is inserted, so a refusal takes no row lock, writes no WAL and commits without
        # a flush (a herd of woken waiters costs reads, not commits). A release that
        # commits after the snapshot sends a NOTIFY that wakes the refused caller. No
        # row at all: the update's WHERE saw a newer version than the snapshot (a
        # concurrent grant): the snapshot could not name that holder, so ask again.
        # A grant that takes the name from another owner (whose lease expired) is
        # announced on the channel; one of a free name only on the grants channel,
        # which only listeners that wait for a holder to appear listen to.
        self.acquire = (
            "WITH now AS MATERIALIZED (SELECT clock_timestamp() AS t),"
            " cur AS MATERIALIZED (SELECT l.token, l.owner, l.identity, l.metadata,"
            f" l.expires_at FROM {t} l WHERE l.name = $1),"
            " held AS MATERIALIZED (SELECT c.token, c.owner, c.identity, c.metadata,"
            " extract(epoch FROM c.expires_at - n.t)::float8 AS remaining"
            " FROM cur c, now n WHERE c.owner <> $2 AND c.expires_at > n.t),"
            f" granted AS (INSERT INTO {t} AS l"
            " (name, token, owner, identity, metadata, ttl, acquired_at, expires_at)"
            " SELECT $1, 1, $2, $3, $4, $5, now.t, now.t + make_interval(secs => $5) FROM now"
            " WHERE NOT EXISTS (SELECT 1 FROM held)"
            " ON CONFLICT (name) DO UPDATE SET"
            f" token = CASE WHEN {retry} THEN l.token ELSE l.token + 1 END,"
            f" acquired_at = CASE WHEN {retry} THEN l.acquired_at ELSE excluded.acquired_at END,"
            f" identity = CASE WHEN {retry} THEN l.identity ELSE excluded.identity END,"
            f" metadata = CASE WHEN {retry} THEN l.metadata ELSE excluded.metadata END,"
            " owner = excluded.owner, ttl = excluded.ttl, expires_at = excluded.expires_at"
            " WHERE l.owner IS NULL OR l.expires_at <= excluded.acquired_at"
            " OR l.owner = excluded.owner"
            " RETURNING l.token, l.acquired_at = (SELECT t FROM now) AS fresh)"
            " SELECT g.token, true AS granted, g.fresh, NULL::text AS owner,"
            " NULL::text AS identity, NULL::text AS metadata, NULL::float8 AS remaining,"
            " CASE WHEN g.fresh THEN pg_notify(CASE WHEN EXISTS (SELECT 1 FROM cur c"
            " WHERE c.owner <> $2) THEN $6 ELSE $7 END,"
            " 'g' || g.token || ':' || length($2) || ':' || $2 || $1) IS NULL END AS notified"
            " FROM granted g"
            " UNION ALL SELECT token, false, NULL, owner, identity, metadata, remaining, NULL"
            " FROM held"
        )
        # $1 names, $2 owners, $3 tokens, $4 ttls: one row per lease.
        self.renew = (
            f"UPDATE {t} AS l SET ttl = v.ttl,"
            " expires_at = clock_timestamp() + make_interval(secs => v.ttl)"
            " FROM unnest($1::text[], $2::text[], $3::int8[], $4::float8[])"
            " AS v(name, owner, token, ttl)"
            ' WHERE l.name = v.name COLLATE "C" AND l.owner = v.owner AND l.token = v.token'
            " AND l.expires_at > clock_timestamp() RETURNING l.name, l.owner, l.token"
        )
        # $1 name, $2 owner, $3 token or NULL, $4 channel.
        self.release = (
            f"WITH r AS (UPDATE {t} SET owner = NULL, identity = NULL, metadata = NULL,"
            " expires_at = NULL WHERE name = $1 AND owner = $2"
            " AND ($3::int8 IS NULL OR token = $3::int8) AND expires_at > clock_timestamp()"
            " RETURNING name, token)"
            " SELECT pg_notify($4, 'r' || r.token || ':' || r.name) IS NULL AS notified FROM r"
        )
        # $1 name, $2 owner, $3 token or NULL, $4 channel, then the next holder's
        # $5 owner, $6 identity, $7 metadata, $8 ttl: release and grant in one statement.
        self.hand_off = (
            "WITH now AS MATERIALIZED (SELECT clock_timestamp() AS t),"
            f" r AS (UPDATE {t} l SET token = l.token + 1, owner = $5, identity = $6,"
            " metadata = $7, ttl = $8, acquired_at = now.t,"
            " expires_at = now.t + make_interval(secs => $8) FROM now"
            " WHERE l.name = $1 AND l.owner = $2 AND ($3::int8 IS NULL OR l.token = $3::int8)"
            " AND l.expires_at > now.t RETURNING l.name, l.token)"
            " SELECT r.token, pg_notify($4, 'g' || r.token || ':' || length($5) || ':' || $5"
            " || r.name) IS NULL"
            " AS notified FROM r"
        )
        self.read = (
            "SELECT l.owner, l.identity, l.token, l.metadata,"
            " extract(epoch FROM l.expires_at - n.t)::float8 AS remaining"
            f" FROM {t} l, (SELECT clock_timestamp() AS t) n"
            " WHERE l.name = $1 AND l.owner IS NOT NULL AND l.expires_at > n.t"
        )


def default_channel(schema: str, table: str) -> str:
    """The NOTIFY channel of a table: ``aiolease_`` and 16 hex digits of its name's hash."""
    digest = hashlib.sha256(f"{schema}.{table}".encode()).hexdigest()
    return f"aiolease_{digest[:16]}"


def advisory_key(schema: str, table: str) -> int:
    """The key of the advisory lock that serialises creating the table."""
    digest = hashlib.sha256(f"aiolease:{schema}.{table}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def grants_channel(channel: str) -> str:
    """The channel that grants of a free name are announced on (beside ``channel``)."""
    if len(channel) <= 61:
        return f"{channel}_g"
    return f"aiolease_g{hashlib.sha256(channel.encode()).hexdigest()[:16]}"


#: What a notification says: (kind, name, owner granted to or ``None``, token or ``None``).
Payload = tuple[str, str, str | None, int | None]


def parse_payload(payload: str) -> Payload:
    """Read a notification: ``'r' + token + ':' + name`` (released), or ``'g' + token +
    ':' + len(owner) + ':' + owner + name`` (granted). Anything else counts as a
    release of an unknown token."""
    kind = payload[:1]
    token, colon, rest = payload[1:].partition(":")
    if kind in ("g", "r") and colon and token.isdigit():
        if kind == "r":
            return "r", rest, None, int(token)
        size, colon, rest = rest.partition(":")
        if colon and size.isdigit() and int(size) <= len(rest):
            return "g", rest[int(size) :], rest[: int(size)], int(token)
    return "r", payload, None, None
