"""The SQL text of the PostgreSQL backend, and what its notifications say (no driver).

See :mod:`aiolease.backends.postgres` for what each statement guarantees, and
:mod:`aiolease.backends.postgres._queue` for the waiters' side of the queue.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from ...abc import Renewal
from ..sql._permits import permit_routine, permit_tables
from ..sql._sweeps import SWEEP_AFTER, SWEEP_LIMIT
from ._permit_functions import acquire_function, batch_function, release_function

__all__ = [
    "array_literals",
    "literals_of",
    "Notice",
    "Payload",
    "Sql",
    "advisory_key",
    "default_channel",
    "grants_channel",
    "parse_notice",
    "PermitSql",
    "parse_payload",
    "permit_key",
    "permit_names_table",
    "permits_table",
    "waiters_table",
]

#: PostgreSQL's longest identifier.
_LONGEST = 63
#: Greater than every ``seq`` of the waiters table (a bigserial).
_LAST = "9223372036854775807"
#: A condition that holds, and turns ``synchronous_commit`` off for the rest of the
#: statement's own transaction (read at its commit), once a row passes it: for the
#: releases that free what they free and grant nothing. Their commit does not wait
#: for the WAL flush (about 200 us here, a third of the release); a crash of the
#: server before the flush (within 3 x ``wal_writer_delay``) undoes the release, and
#: the lease stays its holder's until its ttl runs out, as if the holder had crashed
#: before it released. A grant that comes after the release waits for its own flush,
#: which covers the release's (the WAL is written in order): no later grant is ever
#: durable without it. Grants, renewals and hand-offs always wait.
ASYNC_COMMIT = "set_config('synchronous_commit', 'off', true) IS NOT NULL"


class Sql:
    """The statements for one table and its waiters table (identifiers validated and quoted)."""

    def __init__(self, schema: str, table: str) -> None:
        t = f'"{schema}"."{table}"'
        w = f'"{schema}"."{waiters_table(table)}"'
        self.create = (
            f"CREATE TABLE IF NOT EXISTS {t} ("
            ' name text COLLATE "C" PRIMARY KEY, token bigint NOT NULL,'
            " owner text, identity text, metadata text, ttl double precision,"
            " acquired_at timestamptz, expires_at timestamptz, queued_until timestamptz,"
            " watched_until timestamptz)"
        )
        # The mark of a lease row whose name may have live waiters: NULL, or a time
        # after which none is live (each statement that queues a waiter extends it to at
        # least that waiter row's expiry). And the mark of a row that a wait for a
        # holder to appear watches (``watch``): until then, grants of the free name and
        # releases of grants nobody queued for are announced on the grants channel;
        # else nobody listens for them, and they are not announced at all. Tables made
        # before a mark get both by ``add_marks`` (see ``has_marks``).
        self.has_marks = (
            "SELECT count(*) = 2 AS present FROM pg_attribute WHERE attrelid = $1::text::regclass"
            " AND attname IN ('queued_until', 'watched_until') AND NOT attisdropped"
        )
        self.add_marks = (
            f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS queued_until timestamptz,"
            " ADD COLUMN IF NOT EXISTS watched_until timestamptz"
        )
        # One row per refused caller that may still wait: its place (seq, kept while it
        # asks again in time), what a grant to it needs, the number of the ask that
        # wrote the row (echoed in a hand-off's notification), and its expiry (its own
        # ttl after its latest ask: a waiter that died holds nobody up for longer).
        self.create_waiters = (
            f"CREATE TABLE IF NOT EXISTS {w} ("
            ' name text COLLATE "C" NOT NULL, owner text NOT NULL, identity text,'
            " metadata text, ttl double precision NOT NULL, ask bigint NOT NULL,"
            " seq bigserial NOT NULL, expires_at timestamptz NOT NULL,"
            " PRIMARY KEY (name, owner))"
        )
        # The queue's order, read oldest first by a release without sorting.
        self.create_waiters_index = (
            f'CREATE INDEX IF NOT EXISTS "{waiters_table(table)}_seq" ON {w} (name, seq)'
        )
        retry = "l.owner = excluded.owner AND l.expires_at > excluded.acquired_at"

        # The grant: a new row (of the values or the rows ``source`` gives), or the row
        # updated (a retry by the current owner keeps its token, acquired_at, identity
        # and metadata); the callers add the WHERE.
        def upsert(source: str) -> str:
            return (
                f"INSERT INTO {t} AS l"
                " (name, token, owner, identity, metadata, ttl, acquired_at, expires_at)"
                f" {source} ON CONFLICT (name) DO UPDATE SET"
                f" token = CASE WHEN {retry} THEN l.token ELSE l.token + 1 END,"
                f" acquired_at = CASE WHEN {retry} THEN l.acquired_at"
                " ELSE excluded.acquired_at END,"
                f" identity = CASE WHEN {retry} THEN l.identity ELSE excluded.identity END,"
                f" metadata = CASE WHEN {retry} THEN l.metadata ELSE excluded.metadata END,"
                " owner = excluded.owner, ttl = excluded.ttl, expires_at = excluded.expires_at"
            )

        # How both acquires announce a grant "g": on the channel if it took the name from
        # another owner (the statement's snapshot shows one), else on the grants channel
        # if the row is watched; a retry (not fresh) is not announced.
        payload = "'g' || g.token || ':' || length($2) || ':' || $2 || $1"

        def announced(taken: str, clock: str) -> str:
            return (
                f" CASE WHEN NOT g.fresh THEN NULL WHEN {taken}"
                f" THEN pg_notify($6, {payload}) IS NULL WHEN g.watched_until > {clock}"
                f" THEN pg_notify($7, {payload}) IS NULL END AS notified"
            )

        # $1 name, $2 owner, $3 identity, $4 metadata, $5 ttl, $6 channel, $7 grants
        # channel. The uncontended acquire: one upsert on the lease table only (the
        # waiters table is not even opened), as lean as the plain lease-row upsert. The
        # ON CONFLICT's WHERE, on the newest version of the row (locked), grants only a
        # free or expired row that is not marked (the mark is NULL or past), or a retry
        # by its live holder (a retry ignores the queue, as below). No row: refused (a
        # holder, or a mark), and the caller goes on with the queue-aware ``acquire``,
        # which queues it and says who holds the name. A grant is fresh when its
        # acquired_at is this statement's (a retry keeps an older one).
        self.acquire_fast = (
            "WITH g AS ("
            + upsert(
                "VALUES ($1, 1, $2, $3, $4, $5, clock_timestamp(),"
                " clock_timestamp() + make_interval(secs => $5))"
            )
            + " WHERE (l.owner IS NULL OR l.expires_at <= excluded.acquired_at"
            " OR l.owner = excluded.owner) AND (l.queued_until IS NULL"
            f" OR l.queued_until <= excluded.acquired_at OR ({retry}))"
            " RETURNING l.token, l.acquired_at >= statement_timestamp() AS fresh,"
            " l.watched_until)"
            " SELECT g.token, true AS granted, g.fresh,"
            + announced(
                f"EXISTS (SELECT 1 FROM {t} c WHERE c.name = $1 AND c.owner <> $2)",
                "clock_timestamp()",
            )
            + " FROM g"
        )
        # What the queue-aware acquire answers: the grant, or the holder.
        reply = (
            " SELECT g.token, true AS granted, g.fresh, NULL::text AS owner,"
            " NULL::text AS identity, NULL::text AS metadata, NULL::float8 AS remaining,"
            + announced("EXISTS (SELECT 1 FROM cur c WHERE c.owner <> $2)", "(SELECT t FROM now)")
            + " FROM granted g"
            " UNION ALL SELECT token, false, NULL, owner, identity, metadata, remaining, NULL"
            " FROM held WHERE EXISTS (SELECT 1 FROM refused)"
        )
        # $1 name, $2 owner, $3 identity, $4 metadata, $5 ttl, $6 channel, $7 grants
        # channel, $8 the caller's ask number. The clock is read once (the CTE "now");
        # excluded.acquired_at carries it into the update.
        # "held": the snapshot shows a live holder other than the caller, or, with no
        # live holder at all (not even the caller: a retry ignores the queue), the
        # oldest live waiter queued before the caller (before everybody, if the caller
        # has no live row). Either refuses: the lease row is marked (its mark extended
        # to at least the waiter row's expiry: "marked" locks the lease row, and
        # "queued" reads it, so before the waiter row), then the caller's waiter row is
        # written (its place kept if it was live). Unless the locked row, in its newest
        # version, is no longer the one the snapshot shows ("refused" is then empty): a
        # holder that released after the snapshot was taken, without a hand-off as
        # nobody was queued then, would never wake the caller; no row then (ask again).
        # No row at all: the update's WHERE saw a newer version than the snapshot (a
        # concurrent grant): the snapshot could not name that holder, so ask again. A
        # grant deletes the caller's waiter row, after locking the lease row (every
        # statement locks the lease row before waiter rows: no deadlock). A grant that
        # takes the name from another owner (whose lease expired) is announced on the
        # channel; one of a free name only on the grants channel (which only listeners
        # that wait for a holder to appear listen to), if such a wait watches the row.
        self.acquire = (
            "WITH now AS MATERIALIZED (SELECT clock_timestamp() AS t),"
            " cur AS MATERIALIZED (SELECT l.token, l.owner, l.identity, l.metadata,"
            f" l.expires_at FROM {t} l WHERE l.name = $1),"
            # The name's waiter rows, read once (rarely any).
            f" ws AS MATERIALIZED (SELECT w.owner, w.identity, w.metadata, w.seq, w.expires_at"
            f" FROM {w} w WHERE w.name = $1),"
            # Who the caller must wait for: the live holder, else (nobody holds it
            # live, not even the caller) the oldest live waiter queued before it.
            " held AS MATERIALIZED (SELECT c.token, c.owner, c.identity, c.metadata,"
            " extract(epoch FROM c.expires_at - n.t)::float8 AS remaining"
            " FROM cur c, now n WHERE c.owner <> $2 AND c.expires_at > n.t"
            " UNION ALL (SELECT coalesce((SELECT c.token FROM cur c), 0), a.owner,"
            " a.identity, a.metadata, extract(epoch FROM a.expires_at - n.t)::float8"
            " FROM ws a, now n WHERE a.owner <> $2 AND a.expires_at > n.t"
            " AND NOT EXISTS (SELECT 1 FROM cur c WHERE c.expires_at > n.t)"
            " AND NOT EXISTS (SELECT 1 FROM ws m WHERE m.owner = $2 AND m.expires_at > n.t"
            " AND m.seq < a.seq) ORDER BY a.seq LIMIT 1)),"
            " granted AS ("
            + upsert(
                "SELECT $1, 1, $2, $3, $4, $5, now.t, now.t + make_interval(secs => $5)"
                " FROM now WHERE NOT EXISTS (SELECT 1 FROM held)"
            )
            + " WHERE l.owner IS NULL OR l.expires_at <= excluded.acquired_at"
            " OR l.owner = excluded.owner"
            " RETURNING l.token, l.acquired_at = (SELECT t FROM now) AS fresh, l.watched_until),"
            f" served AS (DELETE FROM {w} d WHERE EXISTS (SELECT 1 FROM granted)"
            " AND EXISTS (SELECT 1 FROM ws m WHERE m.owner = $2) AND d.name = $1 AND d.owner = $2),"
            f" marked AS (UPDATE {t} l"
            " SET queued_until = greatest(l.queued_until, n.t + make_interval(secs => $5))"
            " FROM now n WHERE l.name = $1 AND EXISTS (SELECT 1 FROM held)"
            " RETURNING EXISTS (SELECT 1 FROM cur c WHERE c.token = l.token"
            " AND c.owner IS NOT DISTINCT FROM l.owner) AS same),"
            " refused AS (SELECT 1 FROM marked WHERE same"
            " UNION ALL SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM cur)),"
            f" queued AS (INSERT INTO {w} AS q"
            " (name, owner, identity, metadata, ttl, ask, expires_at)"
            " SELECT $1, $2, $3, $4, $5, $8, n.t + make_interval(secs => $5) FROM now n"
            " WHERE EXISTS (SELECT 1 FROM held) AND EXISTS (SELECT 1 FROM refused)"
            " ON CONFLICT (name, owner) DO UPDATE SET identity = excluded.identity,"
            " metadata = excluded.metadata, ttl = excluded.ttl, ask = excluded.ask,"
            " seq = CASE WHEN q.expires_at > (SELECT t FROM now) THEN q.seq ELSE excluded.seq END,"
            " expires_at = excluded.expires_at)"
            f"{reply}"
        )
        # $1 names, $2 owners, $3 tokens, $4 ttls: one row per lease. Answers the
        # leases it did not renew (usually none: nothing to decode per lease).
        self.renew = (
            "WITH v AS (SELECT * FROM unnest($1::text::text[], $2::text::text[],"
            " $3::text::int8[], $4::text::float8[])"
            " AS v(name, owner, token, ttl)),"
            f" u AS (UPDATE {t} AS l SET ttl = v.ttl,"
            " expires_at = clock_timestamp() + make_interval(secs => v.ttl) FROM v"
            ' WHERE l.name = v.name COLLATE "C" AND l.owner = v.owner AND l.token = v.token'
            " AND l.expires_at > clock_timestamp() RETURNING l.name, l.owner, l.token)"
            " SELECT name, owner, token FROM v EXCEPT ALL SELECT name, owner, token FROM u"
        )
        # $1 name, $2 owner, $3 token or NULL, $4 channel. With a live waiter (other
        # than the caller) the row goes to the oldest one (token + 1, its identity,
        # metadata and ttl, until its own ttl from now or its row's expiry, whichever
        # is sooner), else it is cleared. Either way the caller's waiter row goes too
        # (and, with the lease row locked, the handed waiter's and expired ones: "gone"
        # joins "r", so the lease row is locked before any waiter row). One row always,
        # with "gone" (the owners whose rows it deleted): a handed waiter not in it left
        # meanwhile (its grant must be given back); a caller that had a row but is not
        # in it may have lost the row to a hand-off to itself that committed after
        # this statement's snapshot was taken (which the statement cannot see).
        # The clock is read where it is used (as an UPDATE's own conditions read it):
        # one read per statement would cost a join per use. With no live waiter to hand
        # to, the mark is cleared, unless the row changed after this statement's
        # snapshot (its xmin is not the snapshot's): a waiter that marked it meanwhile
        # is not in the snapshot, and keeps its mark. "lasts": the milliseconds (rounded
        # up) the handed grant lasts at most, unless renewed: announced in the "h"
        # payload, so that the other waiters ask again once it runs out (a dead waiter
        # handed the row holds them up for no longer than that).
        handed = (
            f" r AS (UPDATE {t} l SET"
            " token = CASE WHEN x.owner IS NULL THEN l.token ELSE l.token + 1 END,"
            " owner = x.owner, identity = x.identity, metadata = x.metadata,"
            " ttl = coalesce(x.ttl, l.ttl),"
            " acquired_at = CASE WHEN x.owner IS NULL THEN l.acquired_at"
            " ELSE clock_timestamp() END,"
            " expires_at = least(clock_timestamp() + make_interval(secs => x.ttl), x.expires_at),"
            " queued_until = CASE WHEN x.owner IS NULL AND l.xmin = (SELECT s.xmin"
            f" FROM {t} s WHERE s.name = $1) THEN NULL ELSE l.queued_until END"
            " FROM (SELECT 1) one LEFT JOIN (SELECT o.owner, o.identity, o.metadata, o.ttl, o.ask,"
            f" o.expires_at FROM {w} o WHERE o.name = $1 AND o.owner <> $2"
            " AND o.expires_at > clock_timestamp() ORDER BY o.seq LIMIT 1) x ON true"
            " WHERE l.name = $1 AND l.owner = $2 AND ($3::int8 IS NULL OR l.token = $3::int8)"
            " AND l.expires_at > clock_timestamp() RETURNING l.token, l.owner, x.ask,"
            " greatest(0, ceil(extract(epoch FROM l.expires_at - clock_timestamp()) * 1000))::int8"
            " AS lasts)"
        )
        notify = (
            " CASE WHEN r.token IS NULL THEN NULL"
            " WHEN r.owner IS NULL THEN pg_notify($4, 'r' || r.token || ':' || $1)"
            " ELSE pg_notify($4, 'h' || r.token || ':' || r.ask || ':' || r.lasts"
            " || ':' || length(r.owner)"
            " || ':' || r.owner || $1) END IS NULL AS notified"
        )
        self.release = (
            f"WITH{handed},"
            f" gone AS (DELETE FROM {w} d USING (SELECT max(r.owner) AS owner, count(*) AS n"
            " FROM r) h WHERE d.name = $1 AND (d.owner = $2 OR d.owner = h.owner"
            " OR (h.n > 0 AND d.expires_at <= clock_timestamp())) RETURNING d.owner)"
            " SELECT r.token, r.owner AS handed_to, r.ask, r.lasts,"
            f" (SELECT array_agg(g.owner) FROM gone g) AS gone,{notify}"
            " FROM (SELECT 1) one LEFT JOIN r ON true"
        )
        # The release of an owner that never wrote a waiter row (never refused): as
        # above, but nothing of the caller's to delete or to look for. No row unless
        # it released.
        self.release_held = (
            f"WITH{handed},"
            f" gone AS (DELETE FROM {w} d USING r WHERE d.name = $1"
            " AND (d.owner = r.owner OR d.expires_at <= clock_timestamp()) RETURNING d.owner)"
            " SELECT r.token, r.owner AS handed_to, r.ask, r.lasts,"
            f" (SELECT array_agg(g.owner) FROM gone g) AS gone,{notify}"
            " FROM r"
        )
        # $1 name, $2 owner, $3 token or NULL, $4 channel, $5 whether only observers
        # care (then it is announced only if the row is watched). The uncontended
        # release: the lease table only, and only a row that is not marked. A row if it
        # released; none if the caller does not hold the name, or if the row is marked
        # as having waiters (``release_held`` hands it on).
        self.release_fast = (
            f"WITH r AS (UPDATE {t} SET owner = NULL, identity = NULL, metadata = NULL,"
            " expires_at = NULL WHERE name = $1 AND owner = $2"
            " AND ($3::int8 IS NULL OR token = $3::int8) AND expires_at > clock_timestamp()"
            " AND (queued_until IS NULL OR queued_until <= clock_timestamp())"
            " RETURNING token, watched_until)"
            " SELECT r.token, CASE WHEN NOT $5::bool OR r.watched_until > clock_timestamp()"
            " THEN pg_notify($4, 'r' || r.token || ':' || $1) IS NULL END AS notified FROM r"
            f" WHERE {ASYNC_COMMIT}"
        )
        # $1 name, $2 owner, $3 token, $4 metadata, $5 channel: the holder's new metadata,
        # announced on the channel as "m" (no grant, no release: see ``parse_notice``).
        # A row if it was the caller's grant.
        self.update_metadata = (
            f"WITH u AS (UPDATE {t} SET metadata = $4 WHERE name = $1 AND owner = $2"
            " AND token = $3 AND expires_at > clock_timestamp() RETURNING token)"
            " SELECT u.token, pg_notify($5, 'm' || u.token || ':' || $1) IS NULL AS notified"
            " FROM u"
        )
        # Delete waiter rows of any name that expired SWEEP_AFTER seconds ago or more,
        # at most SWEEP_LIMIT (see ``Sweeps``). Only rows nobody has locked (SKIP
        # LOCKED): it never waits, so it takes part in no deadlock, whatever order it
        # meets the rows in; a row being refreshed is left to the next sweep.
        self.sweep = (
            f"DELETE FROM {w} d WHERE d.ctid = ANY(ARRAY(SELECT s.ctid FROM {w} s"
            f" WHERE s.expires_at < clock_timestamp() - make_interval(secs => {SWEEP_AFTER})"
            f" LIMIT {SWEEP_LIMIT} FOR UPDATE SKIP LOCKED))"
        )
        # $1 name, $2 seconds: mark the row watched for that long (a row made for it
        # is free, token 0: the first grant's is 1), and read it. The row's lock orders
        # this against every grant and release: one that comes after sees the mark.
        self.watch = (
            "WITH n AS MATERIALIZED (SELECT clock_timestamp() AS t),"
            f" w AS (INSERT INTO {t} AS l (name, token, watched_until)"
            " SELECT $1, 0, n.t + make_interval(secs => $2) FROM n"
            " ON CONFLICT (name) DO UPDATE SET"
            " watched_until = greatest(l.watched_until, excluded.watched_until)"
            " RETURNING l.owner, l.identity, l.token, l.metadata, l.expires_at)"
            " SELECT w.owner, w.identity, w.token, w.metadata,"
            " extract(epoch FROM w.expires_at - n.t)::float8 AS remaining"
            " FROM w, n WHERE w.owner IS NOT NULL"
            " AND (w.expires_at > n.t OR w.expires_at IS NULL)"
        )
        # A held row with no expiry is not aiolease's: read, it is reported as foreign
        # (remaining NULL). No statement grants over it, as none counts it expired.
        self.read = (
            "SELECT l.owner, l.identity, l.token, l.metadata,"
            " extract(epoch FROM l.expires_at - n.t)::float8 AS remaining"
            f" FROM {t} l, (SELECT clock_timestamp() AS t) n"
            " WHERE l.name = $1 AND l.owner IS NOT NULL"
            " AND (l.expires_at > n.t OR l.expires_at IS NULL)"
        )


def waiters_table(table: str) -> str:
    """The waiters table of ``table``: ``<table>_waiters``, or, where that would pass
    PostgreSQL's 63-character limit, ``aiolease_w`` and 16 hex digits of a hash."""
    if len(table) <= 55:
        return f"{table}_waiters"
    return f"aiolease_w{hashlib.sha256(table.encode()).hexdigest()[:16]}"


def permits_table(table: str) -> str:
    """The permits table of ``table`` (see
    :func:`~aiolease.backends.sql._permits.permit_tables`)."""
    return permit_tables(table, _LONGEST)[0]


def permit_names_table(table: str) -> str:
    """The permit names table of ``table``."""
    return permit_tables(table, _LONGEST)[1]


def permit_key(name: str) -> str:
    """The key that wakes the permit waiters of ``name`` (in ``Wakeups`` and the
    listener's notes), apart from the lock's: a name never holds NUL."""
    return "\x00permits:" + name


#: The columns of a permit row, in the order :func:`~aiolease.backends.sql._permits.permit_row`
#: takes them (after the table and the name).
PERMIT_COLUMNS = (
    "owner", "weight", "lim", "granted", "seq", "token", "identity", "metadata", "remaining"
)  # fmt: skip


class PermitSql:
    """The statements of the permits of one lease table (see
    :mod:`aiolease.backends.sql._permits`; identifiers validated and quoted).

    An acquire is one statement, one round trip: ``acquire`` calls the function that
    ``create_acquire`` installs (a PL/pgSQL function: each of its statements takes a
    snapshot of its own, so the read after the name's row is locked shows every permit
    committed before, which one statement's single snapshot could not). Every other
    statement is one round trip of its own. Expiry is judged on the server's clock
    (``clock_timestamp()``).
    """

    def __init__(self, schema: str, table: str) -> None:
        p = f'"{schema}"."{permits_table(table)}"'
        n = f'"{schema}"."{permit_names_table(table)}"'
        f = f'"{schema}"."{permit_routine(table, _LONGEST)}"'
        r = f'"{schema}"."{permit_routine(table, _LONGEST, "release")}"'
        b = f'"{schema}"."{permit_routine(table, _LONGEST, "batch")}"'
        self.where = p  # as errors name the table
        self.routine = f
        self.release_routine = r
        self.batch_routine = b
        # One row per held permit (granted, with its token) or queue entry (its place
        # ``seq``, no token), each with the weight and limit it asked for.
        self.create = (
            f"CREATE TABLE IF NOT EXISTS {p} ("
            ' name text COLLATE "C" NOT NULL, owner text NOT NULL, weight bigint NOT NULL,'
            " lim bigint NOT NULL, granted boolean NOT NULL, seq bigint NOT NULL,"
            " token bigint, identity text, metadata text, ttl double precision NOT NULL,"
            " expires_at timestamptz NOT NULL, PRIMARY KEY (name, owner))"
        )
        # Per name: the latest token granted and the latest queue place given. Never
        # deleted, so tokens only grow.
        self.create_names = (
            f"CREATE TABLE IF NOT EXISTS {n} ("
            ' name text COLLATE "C" PRIMARY KEY, token bigint NOT NULL, seq bigint NOT NULL)'
        )
        # Whether the acquire function exists ($1: its qualified name): setup creates it
        # only if not, so that it never rewrites the catalog for nothing.
        self.has_acquire = "SELECT to_regproc($1) IS NOT NULL AS present"
        self.create_acquire = acquire_function(f, p, n)
        self.create_release = release_function(r, p, n)
        self.create_batch = batch_function(b, f, r)
        # $1 name, $2 owner, $3 weight, $4 limit, $5 identity, $6 metadata, $7 ttl. One
        # row "grant" or "renew" (the token in "tok"); else, with "act": "queue" or
        # "refresh" (refused), the blocker's row (the live permit that expires first, or
        # the first queue entry of another owner); "mismatch" (another limit: nothing
        # written), the first live row; "foreign" (a row aiolease would not have
        # written: nothing written), the live rows in arrival order, read and reported.
        self.acquire = (
            f"SELECT act, tok, {', '.join(PERMIT_COLUMNS)} FROM {f}($1, $2, $3::int8,"
            " $4::int8, $5, $6, $7::float8)"
        )
        columns = ", ".join(f"p.{c}" for c in PERMIT_COLUMNS[:-1])
        # $1 name: the live rows, read (``read_permits``).
        self.read = (
            f"SELECT {columns}, extract(epoch FROM p.expires_at - c.t)::float8 AS remaining"
            f" FROM {p} p, (SELECT clock_timestamp() AS t) c"
            " WHERE p.name = $1 AND p.expires_at > c.t ORDER BY p.seq"
        )
        # $1 names, $2 owners, $3 tokens, $4 ttls (array literals, as the locks' renew
        # takes them): one row per permit. Answers those it did not renew (usually none).
        self.renew = (
            "WITH v AS (SELECT * FROM unnest($1::text::text[], $2::text::text[],"
            " $3::text::int8[], $4::text::float8[]) AS v(name, owner, token, ttl)),"
            f" u AS (UPDATE {p} AS p SET ttl = v.ttl,"
            " expires_at = clock_timestamp() + make_interval(secs => v.ttl) FROM v"
            ' WHERE p.name = v.name COLLATE "C" AND p.owner = v.owner AND p.token = v.token'
            " AND p.granted AND p.expires_at > clock_timestamp()"
            " RETURNING p.name, p.owner, p.token)"
            " SELECT name, owner, token FROM v EXCEPT ALL SELECT name, owner, token FROM u"
        )
        # $1 name, $2 owner, $3 token or NULL, $4 channel, $5 the owners queued through
        # this backend object (not told by ``NOTIFY``: the answer hands them their
        # grants): delete the caller's permit (of that token) or queue entry, and grant
        # the queue entries that then fit (``_permit_functions.release_function``). One
        # row: whether a live permit was freed, whether anything was deleted, how many
        # entries stay queued, and the owners, tokens and ttls of the grants.
        self.release = (
            "SELECT freed, deleted, still_queued, owners, tokens, ttls"
            f" FROM {r}($1, $2, $3::int8, $4, $5::text[])"
        )
        # $1 name, $2 kinds ("a" acquire, "r" release: one letter per operation), $3
        # owners, $4 tokens (a release's, or NULL), $5 weights, $6 limits, $7 identities,
        # $8 metadata, $9 ttls (an acquire's, else NULL), $10 channel, $11 the owners
        # queued through this backend object (as the release's $5): the operations of
        # one name in order, in one transaction (``_permit_functions.batch_function``).
        # Each answers the rows its own statement would, "i" its place (from 1).
        self.batch = (
            f"SELECT i, act, tok, {', '.join(PERMIT_COLUMNS)}, freed, deleted, still_queued,"
            f" owners, tokens, ttls FROM {b}($1, $2, $3::text[], $4::int8[], $5::int8[],"
            " $6::int8[], $7::text[], $8::text[], $9::float8[], $10, $11::text[])"
        )
        # $1 name, $2 owner, $3 token or NULL, $4 channel: the release of a backend that
        # saw nobody queue for the name: delete the caller's permit (of that token) or
        # queue entry and, if anything went, tell every waiter of the name (``'p:'``),
        # which asks again (a request queued elsewhere that now fits is granted by its
        # own ask). No lock on the name's row: releases of one name run side by side.
        self.release_plain = (
            f"WITH d AS (DELETE FROM {p} WHERE name = $1 AND owner = $2"
            " AND (NOT granted OR $3::int8 IS NULL OR token = $3::int8)"
            " RETURNING granted AND expires_at > clock_timestamp() AS live)"
            " SELECT coalesce(bool_or(d.live), false) AS freed, count(*) > 0 AS deleted,"
            " CASE WHEN count(*) > 0 THEN pg_notify($4, 'p:' || $1) END IS NULL AS notified"
            f" FROM d WHERE {ASYNC_COMMIT}"
        )


def default_channel(schema: str, table: str) -> str:
    """The NOTIFY channel of a table: ``aiolease_`` and 16 hex digits of its name's hash."""
    digest = hashlib.sha256(f"{schema}.{table}".encode()).hexdigest()
    return f"aiolease_{digest[:16]}"


def advisory_key(schema: str, table: str) -> int:
    """The key of the advisory lock that serialises creating the tables."""
    digest = hashlib.sha256(f"aiolease:{schema}.{table}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def grants_channel(channel: str) -> str:
    """The channel that grants of a free name are announced on (beside ``channel``)."""
    if len(channel) <= 61:
        return f"{channel}_g"
    return f"aiolease_g{hashlib.sha256(channel.encode()).hexdigest()[:16]}"


#: What a notification says: (kind, name, owner granted to or ``None``, token or ``None``).
Payload = tuple[str, str, str | None, int | None]
#: :data:`Payload` and, for a hand-off, the number of the waiter's ask it saw and the
#: seconds the handed grant lasts at most (unless renewed), counted from when the
#: release ran (else ``None`` and ``None``).
Notice = tuple[str, str, str | None, int | None, int | None, float | None]


def parse_payload(payload: str) -> Payload:
    """Read a notification: ``'r' + token + ':' + name`` (released), ``'g' + token +
    ':' + len(owner) + ':' + owner + name`` (granted), ``'h' + token + ':' + ask +
    ':' + ms + ':' + len(owner) + ':' + owner + name`` (handed to a waiter, for ``ms``
    milliseconds at most unless renewed: a grant, kind ``'g'`` here), or ``'m' + token
    + ':' + name`` (grant ``token``'s metadata changed: neither a grant nor a release).
    Anything else counts as a release of an unknown token."""
    kind, name, owner, token, _ask, _lasts = parse_notice(payload)
    return kind, name, owner, token


def parse_notice(payload: str) -> Notice:
    """:func:`parse_payload`, and the ask number and the most seconds of a hand-off."""
    kind = payload[:1]
    if payload.startswith("p:"):  # a permit or queue entry of a name went (version 1)
        return "p", payload[2:], None, None, None, None
    if kind == "q":  # queue entries granted by a release: their owners, joined by ","
        size, colon, rest = payload[1:].partition(":")
        if colon and size.isdecimal() and int(size) <= len(rest):
            return "q", rest[int(size) :], rest[: int(size)], None, None, None
        return "r", payload, None, None, None, None
    token, colon, rest = payload[1:].partition(":")
    if kind in ("g", "r", "h", "m") and colon and token.isdecimal():
        if kind in ("r", "m"):
            return kind, rest, None, int(token), None, None
        ask = lasts = None
        if kind == "h":
            number, colon, rest = rest.partition(":")
            ms, colon_ms, rest = rest.partition(":")
            if not (colon and number.isdecimal() and colon_ms and ms.isdecimal()):
                return "r", payload, None, None, None, None
            ask, lasts = int(number), int(ms) / 1000
        size, colon, rest = rest.partition(":")
        if colon and size.isdecimal() and int(size) <= len(rest):
            return "g", rest[int(size) :], rest[: int(size)], int(token), ask, lasts
    return "r", payload, None, None, None, None


def _quoted(text: str) -> str:
    """``text`` as an element of a PostgreSQL array literal: in double quotes, with
    ``"`` and ``\\`` escaped (all else, commas and braces included, is taken as is)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def array_literals(renewals: Sequence[Renewal]) -> tuple[str, str, str, str]:
    """The renew statement's parameters: the names, owners, tokens and ttls of
    ``renewals`` as array literals (``{...}``), sent as four text values that the
    server casts. Encoding them here once per list of the core's (``derived``)
    spares asyncpg encoding every element of four arrays on every tick."""
    names = ",".join([_quoted(r[0]) for r in renewals])
    owners = ",".join([_quoted(r[1]) for r in renewals])
    tokens = ",".join([str(int(r[2])) for r in renewals])
    ttls = ",".join([repr(float(r[3])) for r in renewals])
    return f"{{{names}}}", f"{{{owners}}}", f"{{{tokens}}}", f"{{{ttls}}}"


def literals_of(
    batch: Sequence[Renewal],
) -> Callable[[Sequence[Renewal]], tuple[str, str, str, str]]:
    """Makes :func:`array_literals` of ``batch`` (a part of the list it is given)."""
    return lambda _: array_literals(batch)
