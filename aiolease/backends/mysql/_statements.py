"""The SQL text of the MySQL / MariaDB backend (no driver).

See :mod:`aiolease.backends.mysql` for what each statement guarantees.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..sql._permits import permit_routine, permit_tables
from ._procedures import acquire_procedure, batch_procedure, release_procedure

__all__ = [
    "COUNT",
    "EXPIRED",
    "ID",
    "MAX_RENEWALS",
    "ROWS",
    "SETS",
    "WAITERS_SUFFIX",
    "PermitSql",
    "Prepared",
    "Sql",
    "batch_ops",
    "micros",
]

#: What the backend's ``_execute`` returns: the insert id, the rows, the row count, or
#: the rows of each result set (of a ``CALL``, read to its end).
ID, ROWS, COUNT, SETS = "id", "rows", "count", "sets"
#: The most leases one renew statement renews: 5 parameters each (of leases with
#: different ttls) stay under the 65,535 placeholders a MySQL statement may have.
MAX_RENEWALS = 10_000


def micros(ttl: float) -> int:
    """``ttl`` in whole microseconds (at least one), as the statements take it."""
    return max(round(ttl * 1_000_000), 1)


_NOW = "UTC_TIMESTAMP(6)"
_EXPIRY = f"{_NOW} + INTERVAL %(us)s MICROSECOND"
#: The caller already holds it, live: an idempotent retry (or a hand-off to it).
_RETRY = f"(owner <=> %(owner)s AND expires_at > {_NOW})"
_MINE = "owner <=> %(owner)s"
#: A row with an owner is held: live, or with no expiry (not aiolease's: it is never
#: granted over, and reading it raises ForeignDataError).
_HELD = f"IFNULL(expires_at > {_NOW}, TRUE)"
#: Waiters may be queued for the row.
_QUEUED = f"IFNULL(queued > {_NOW}, FALSE)"
#: What the acquire statement reports for a row that expired under another owner (a
#: token never comes near it).
EXPIRED = 1 << 63
#: The waiters table is named after the lease table plus this.
WAITERS_SUFFIX = "_waiters"


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

#: asyncmy's (and MySQL's) server status flag: string literals quote ``'`` by doubling
#: it, and a backslash is an ordinary character.
_NO_BACKSLASH_ESCAPES = 512


class Rendered:
    """A plain statement whose parameters are rendered into its text once per quoting
    mode of the connections that run it (``NO_BACKSLASH_ESCAPES`` or not), not on every
    call: a renewal batch that the core hands again tick after tick.

    :param sql: the statement, with ``%s`` parameters
    :param params: its parameters
    """

    __slots__ = ("_texts", "params", "sql")

    def __init__(self, sql: str, params: Sequence[Any]) -> None:
        self.sql = sql
        self.params = params
        self._texts: dict[int, str] = {}

    def text(self, cursor: Any, conn: Any) -> str:
        """The statement as ``cursor`` (of ``conn``) would render it."""
        mode = int(conn.server_status) & _NO_BACKSLASH_ESCAPES
        text = self._texts.get(mode)
        if text is None:
            text = self._texts[mode] = cursor.mogrify(self.sql, self.params)
        return text


class Sql:
    """The statements for one table and its waiters table (identifiers validated and
    quoted)."""

    def __init__(self, table: str) -> None:
        t = f"`{table}`"
        w = f"`{table}{WAITERS_SUFFIX}`"
        self.create = (
            f"CREATE TABLE IF NOT EXISTS {t} ("
            " name VARBINARY(255) NOT NULL PRIMARY KEY, token BIGINT UNSIGNED NOT NULL,"
            " owner VARBINARY(255) NULL, identity VARBINARY(1024) NULL, metadata BLOB NULL,"
            " ttl DOUBLE NULL, acquired_at DATETIME(6) NULL, expires_at DATETIME(6) NULL,"
            " queued DATETIME(6) NULL) ENGINE=InnoDB",
            # seq: queue order (AUTO_INCREMENT, kept when a waiter refreshes its row).
            f"CREATE TABLE IF NOT EXISTS {w} ("
            " seq BIGINT UNSIGNED NOT NULL AUTO_INCREMENT PRIMARY KEY,"
            " name VARBINARY(255) NOT NULL, owner VARBINARY(255) NOT NULL,"
            " identity VARBINARY(1024) NOT NULL, metadata BLOB NOT NULL,"
            " ttl DOUBLE NOT NULL, us BIGINT UNSIGNED NOT NULL, expires_at DATETIME(6) NOT NULL,"
            " UNIQUE KEY who (name, owner), KEY queue (name, seq)"
            ") ENGINE=InnoDB",
        )
        # How many live waiters of the name are ahead of the caller: older than its own
        # live entry (all of them if it has none), not the caller, not the row's holder
        # (a waiter that was granted keeps its entry until it releases).
        ahead = (
            f"(SELECT COUNT(*) FROM {w} AS q LEFT JOIN {w} AS m ON m.name = q.name"
            f" AND m.owner = %(owner)s AND m.expires_at > {_NOW} WHERE q.name = %(name)s"
            f" AND q.expires_at > {_NOW} AND q.owner <> %(owner)s"
            " AND NOT q.owner <=> {row}.owner AND (m.seq IS NULL OR q.seq < m.seq))"
        )
        # Assignment order matters. The token is decided first, from the untouched row,
        # and leaves its verdict in LAST_INSERT_ID() (the token granted, 0, or
        # ``EXPIRED``), which the later assignments read: acquired_at, identity and
        # metadata are kept by a retry (``_RETRY`` still reads the untouched owner and
        # expiry), owner is decided next, and the rest follow the new owner.
        granted = f"(LAST_INSERT_ID() BETWEEN 1 AND {EXPIRED - 1})"
        fresh = f"({granted} AND NOT {_RETRY})"
        rest = (
            f" acquired_at = IF({fresh}, {_NOW}, acquired_at),"
            f" identity = IF({fresh}, %(identity)s, identity),"
            f" metadata = IF({fresh}, %(metadata)s, metadata),"
            f" owner = IF({granted}, %(owner)s, owner),"
            f" ttl = IF({_MINE}, %(ttl)s, ttl),"
            f" expires_at = IF({_MINE}, {_EXPIRY}, expires_at)"
        )
        insert = (
            f"INSERT INTO {t} (name, token, owner, identity, metadata, ttl, acquired_at,"
            " expires_at) VALUES (%(name)s, LAST_INSERT_ID(1), %(owner)s, %(identity)s,"
            f" %(metadata)s, %(ttl)s, {_NOW}, {_EXPIRY})"
            " ON DUPLICATE KEY UPDATE token = CASE"
            f" WHEN {_RETRY} THEN LAST_INSERT_ID(token)"
            f" WHEN {_MINE} OR (owner IS NULL AND NOT {_QUEUED})"
            " THEN LAST_INSERT_ID(token + 1)"
            f" WHEN owner IS NOT NULL AND {_HELD} THEN token + LAST_INSERT_ID(0)"
        )
        # A free row is anyone's unless waiters may be queued (``queued``: a release
        # hands the row to the oldest live waiter, so it is rarely free then). That row,
        # or one that expired under another owner, is not decided here (a statement that
        # names the waiters table costs every acquire, even where none waits):
        # ``EXPIRED`` sends the caller to ``take_over``.
        self.acquire = Prepared.of(
            f"{insert} ELSE token + (LAST_INSERT_ID({EXPIRED}) AND 0) END,{rest}"
        )
        # The same, but such a row goes to the oldest live waiter (not the expired
        # holder), or to anyone if none waits.
        oldest = (
            f"(SELECT q.owner FROM {w} AS q WHERE q.name = %(name)s AND q.expires_at > {_NOW}"
            f" AND NOT q.owner <=> {t}.owner ORDER BY q.seq LIMIT 1)"
        )
        self.take_over = Prepared.of(
            f"{insert} WHEN IFNULL({oldest}, %(owner)s) = %(owner)s"
            f" THEN LAST_INSERT_ID(token + 1) ELSE token + LAST_INSERT_ID(0) END,{rest}"
        )
        # A waiter's look, without a lock or a write: the token, whether the row is the
        # caller's (handed to it) and live, whether it is free or expired, and how many
        # live waiters are ahead of the caller.
        # Then the place of the entry just ahead of the caller's (its predecessor, whose
        # bell it waits on: see :mod:`aiolease.backends.mysql._bell`): live, or the
        # holder's (a granted waiter keeps its entry, unrefreshed, until it releases);
        # last, the microseconds the row has left.
        self.peek = Prepared.of(
            f"SELECT l.token, l.owner <=> %(owner)s AND l.expires_at > {_NOW},"
            f" l.owner IS NULL OR l.expires_at <= {_NOW}, {ahead.format(row='l')},"
            f" (SELECT MAX(p.seq) FROM {w} AS p WHERE p.name = %(name)s AND p.seq < %(seq)s"
            f" AND (p.expires_at > {_NOW} OR p.owner <=> l.owner)),"
            f" TIMESTAMPDIFF(MICROSECOND, {_NOW}, l.expires_at)"
            f" FROM {t} AS l WHERE l.name = %(name)s"
        )
        # A wait on a bell, then a look (see :mod:`aiolease.backends.mysql._bell`), in one
        # statement: the bell is let go in the step it is got (1: it was let go, or
        # free; 0: timed out), and the row is read after (a subquery that names the
        # derived table's column runs only once it is made; ``LIMIT`` keeps the derived
        # table from being merged away): its token, and the microseconds it has left if
        # it is the caller's and live, else -1.
        row = f"FROM {t} WHERE name = %(name)s AND g.r IS NOT NULL"
        self.ring = Prepared.of(
            f"SELECT g.r, (SELECT token {row}),"
            f" (SELECT IF({_RETRY}, TIMESTAMPDIFF(MICROSECOND, {_NOW}, expires_at), -1) {row})"
            " FROM (SELECT IF(GET_LOCK(%(bell)s, %(seconds)s), RELEASE_LOCK(%(bell)s), 0) AS r"
            " LIMIT 1) AS g"
        )
        self.holder = Prepared.of(
            "SELECT owner, identity, token, metadata,"
            f" TIMESTAMPDIFF(MICROSECOND, {_NOW}, expires_at) FROM {t}"
            f" WHERE name = %(name)s AND owner IS NOT NULL AND {_HELD}"
        )
        # Whom a refusal reports when the row is free but kept for the oldest waiter.
        self.reserved = Prepared.of(
            "SELECT q.owner, q.identity, l.token, q.metadata,"
            f" TIMESTAMPDIFF(MICROSECOND, {_NOW}, q.expires_at) FROM {w} AS q"
            f" JOIN {t} AS l ON l.name = q.name WHERE q.name = %(name)s"
            f" AND q.owner <> %(owner)s AND q.expires_at > {_NOW} ORDER BY q.seq LIMIT 1"
        )
        self.renew = (
            f"UPDATE {t} SET token = LAST_INSERT_ID(token), ttl = %(ttl)s,"
            f" expires_at = {_EXPIRY} WHERE name = %(name)s AND owner = %(owner)s"
            f" AND token = %(token)s AND expires_at > {_NOW}"
        )
        # The holder's new metadata (insert id: the token if it was the caller's, else 0).
        self.update_metadata = Prepared.of(
            f"UPDATE {t} SET token = LAST_INSERT_ID(token), metadata = %(metadata)s"
            " WHERE name = %(name)s AND owner = %(owner)s"
            f" AND token = %(token)s AND expires_at > {_NOW}"
        )
        # Release: free the row, unless waiters may be queued (then, or when it is not
        # the caller's, the insert id is 0 and the caller asks ``release_queued``; the
        # token when freed).
        mine = (
            " WHERE name = %(name)s AND owner = %(owner)s"
            f" AND (%(token)s IS NULL OR token = %(token)s) AND expires_at > {_NOW}"
        )
        self.release = Prepared.of(
            f"UPDATE {t} SET token = LAST_INSERT_ID(token), owner = NULL, identity = NULL,"
            f" metadata = NULL, expires_at = NULL{mine} AND NOT {_QUEUED}"
        )
        # Release, or hand to the oldest live waiter (token + 1, its ttl, identity and
        # metadata) if there is one: the row joined with the live waiters other than
        # the caller that have none such older than them. A multi-table UPDATE assigns
        # in no fixed order: each assignment reads only its own column and the
        # waiter's entry. The insert id is the row's token after it: the caller's own
        # when freed, one more when handed.
        live = f"expires_at > {_NOW} AND {{0}}.owner <> %(owner)s"
        self.release_queued = Prepared.of(
            f"UPDATE {t} AS l LEFT JOIN {w} AS q ON q.name = l.name AND q.{live.format('q')}"
            f" LEFT JOIN {w} AS o ON o.name = q.name AND o.seq < q.seq AND o.{live.format('o')}"
            " SET l.token = LAST_INSERT_ID(l.token + (q.owner IS NOT NULL)),"
            " l.owner = q.owner, l.identity = q.identity, l.metadata = q.metadata,"
            " l.ttl = IFNULL(q.ttl, l.ttl),"
            f" l.acquired_at = IF(q.owner IS NULL, l.acquired_at, {_NOW}),"
            f" l.expires_at = IF(q.owner IS NULL, NULL, {_NOW} + INTERVAL q.us MICROSECOND)"
            f"{mine.replace(' name', ' l.name').replace(' owner', ' l.owner')}".replace(
                " token =", " l.token =", 1
            ).replace("AND expires_at", "AND l.expires_at")
            + " AND o.seq IS NULL"
        )
        # Release and grant to a waiter of this backend in one statement, if no older
        # live waiter elsewhere is ahead of it (WHERE reads the old row; the token is
        # assigned first, so LAST_INSERT_ID carries the new one back).
        self.hand_off = Prepared.of(
            f"UPDATE {t} SET token = LAST_INSERT_ID(token + 1), owner = %(next)s,"
            " identity = %(identity)s, metadata = %(metadata)s, ttl = %(ttl)s,"
            f" acquired_at = {_NOW}, expires_at = {_EXPIRY}"
            " WHERE name = %(name)s AND owner = %(owner)s"
            f" AND (%(token)s IS NULL OR token = %(token)s) AND expires_at > {_NOW}"
            f" AND IFNULL((SELECT q.owner FROM {w} AS q WHERE q.name = %(name)s"
            f" AND q.owner <> %(owner)s AND q.expires_at > {_NOW} ORDER BY q.seq LIMIT 1),"
            " %(next)s) = %(next)s"
        )
        # Mark the row as having waiters until a second after the entry that comes next
        # runs out: releases and acquires look at the queue until then.
        self.mark = Prepared.of(
            f"UPDATE {t} SET queued = GREATEST(IFNULL(queued, {_NOW}),"
            f" {_EXPIRY} + INTERVAL 1 SECOND) WHERE name = %(name)s"
        )
        # Join the queue, or refresh one's entry (keeping its place) for another ttl; the
        # insert id is its place (``seq``).
        self.wait = Prepared.of(
            f"INSERT INTO {w} (name, owner, identity, metadata, ttl, us, expires_at)"
            " VALUES (%(name)s, %(owner)s, %(identity)s, %(metadata)s, %(ttl)s, %(us)s,"
            f" {_EXPIRY}) ON DUPLICATE KEY UPDATE seq = LAST_INSERT_ID(seq),"
            " identity = %(identity)s, metadata = %(metadata)s, ttl = %(ttl)s, us = %(us)s,"
            f" expires_at = {_EXPIRY}"
        )
        # Leave the queue (by the unique key: one row locked, no range).
        self.leave = Prepared.of(f"DELETE FROM {w} WHERE name = %(name)s AND owner = %(owner)s")
        # Entries that expired at least a while ago (microseconds), at most so many,
        # but for the entry of a live holder (a granted waiter keeps its entry until
        # it releases: the entry behind it waits on its bell): a plain SELECT, which
        # locks nothing. ``sweep`` then deletes them by their primary key.
        self.expired = (
            f"SELECT q.seq FROM {w} AS q LEFT JOIN {t} AS l ON l.name = q.name"
            f" AND l.owner = q.owner AND l.expires_at > {_NOW}"
            f" WHERE q.expires_at < {_NOW} - INTERVAL %s MICROSECOND AND l.name IS NULL"
            " LIMIT %s"
        )
        self._waiters = w
        self._table = t
        self.has_queued = (
            "SELECT COUNT(*) FROM information_schema.columns WHERE table_schema = DATABASE()"
            f" AND table_name = '{table}' AND column_name = 'queued'"
        )
        self.add_queued = f"ALTER TABLE {t} ADD COLUMN queued DATETIME(6) NULL"

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

    def sweep(self, count: int) -> str:
        """Delete ``count`` entries by their ``seq`` if they are still expired (one
        refreshed meanwhile stays): params the seqs, then the microseconds."""
        seqs = ", ".join(["%s"] * count)
        return (
            f"DELETE FROM {self._waiters} WHERE seq IN ({seqs})"
            f" AND expires_at < {_NOW} - INTERVAL %s MICROSECOND"
        )

    def live(self, count: int) -> str:
        """Which of ``count`` (name, owner, token) triples hold a live row."""
        return (
            f"SELECT name, owner, token FROM {self._table}"
            f" WHERE (name, owner, token) IN ({_triples(count)}) AND expires_at > {_NOW}"
        )


def _triples(count: int) -> str:
    return ", ".join(["(%s, %s, %s)"] * count)


class PermitSql:
    """The statements of the permits of one lease table (see
    :mod:`aiolease.backends.sql._permits`; identifiers validated and quoted).

    An acquire is one round trip: ``acquire`` calls the procedure that
    ``create_acquire`` installs, which runs one transaction: it locks the name's row
    (made if missing), then reads the name's rows with locking reads (which see every
    permit committed before, whatever the isolation level), and grants, queues or
    refuses (see :func:`~aiolease.backends.sql._permits.acquired`). Expiry is judged on
    the server's clock (``UTC_TIMESTAMP(6)``).
    """

    def __init__(self, table: str) -> None:
        permits, names = permit_tables(table, 64)
        p, n = f"`{permits}`", f"`{names}`"
        f = f"`{permit_routine(table, 64)}`"
        r = f"`{permit_routine(table, 64, 'release')}`"
        b = f"`{permit_routine(table, 64, 'batch')}`"
        take = f"`{permit_routine(table, 64, 'take')}`"
        self.where = p  # as errors name the table
        self._permits = p
        self.create = (
            f"CREATE TABLE IF NOT EXISTS {p} ("
            " name VARBINARY(255) NOT NULL, owner VARBINARY(255) NOT NULL,"
            " weight BIGINT NOT NULL, lim BIGINT NOT NULL, granted TINYINT NOT NULL,"
            " seq BIGINT UNSIGNED NOT NULL, token BIGINT UNSIGNED NULL,"
            " identity VARBINARY(1024) NULL, metadata BLOB NULL, ttl DOUBLE NOT NULL,"
            " expires_at DATETIME(6) NOT NULL, waited TINYINT NOT NULL DEFAULT 0,"
            " PRIMARY KEY (name, owner)) ENGINE=InnoDB",
            f"CREATE TABLE IF NOT EXISTS {n} ("
            " name VARBINARY(255) NOT NULL PRIMARY KEY, token BIGINT UNSIGNED NOT NULL,"
            " seq BIGINT UNSIGNED NOT NULL) ENGINE=InnoDB",
        )
        # ``waited``: whether a request may have queued behind a permit since its grant
        # (then its release grants, by the procedure); added to a table made before it.
        self.has_waited = (
            "SELECT COUNT(*) FROM information_schema.columns WHERE table_schema = DATABASE()"
            f" AND table_name = '{permits}' AND column_name = 'waited'"
        )
        self.add_waited = f"ALTER TABLE {p} ADD COLUMN waited TINYINT NOT NULL DEFAULT 0"
        # Made once (error 1304, "already exists", from a second maker is no error).
        self.create_acquire = acquire_procedure(f, p, n)
        self.create_release = release_procedure(r, p, n)
        # The batch: the acquire's step (the same rules, without a transaction of its
        # own), and the procedure that runs several acquires and releases, in order, in
        # one transaction (see ``batch``).
        self.create_batch = (
            acquire_procedure(take, p, n, step=True),
            batch_procedure(b, take, p, n),
        )
        # One result set: "act" (see ``acquired``) and "tok" (the token of a grant or a
        # renewal, answered after the commit: nothing is reported granted before it is
        # durable); for a refusal ("tok" NULL), then the columns of a permit row: the
        # live permits, the caller's entry and the first entry of another ("foreign" and
        # "mismatch": every live row), in arrival order, one per row.
        self.acquire = (
            f"CALL {f}(%(name)s, %(owner)s, %(weight)s, %(lim)s, %(identity)s,"
            " %(metadata)s, %(ttl)s, %(us)s)"
        )
        # The same as a prepared statement, for connections that may have a prepared
        # ``CALL`` answer result sets (``PS_MULTI_RESULTS``: a backend made from a URL
        # asks for it): parsed once per connection, its parameters sent as binary.
        self.acquire_prepared = Prepared.of(self.acquire)
        # A wait on the bell of the permit or queue entry that blocks a waiter (see
        # ``_bell``): 1 when it was let go (or was free), else 0; nothing else to look at.
        self.ring = Prepared.of(
            "SELECT IF(GET_LOCK(%(bell)s, %(seconds)s), RELEASE_LOCK(%(bell)s), 0)"
        )
        columns = (
            "owner, weight, lim, granted, seq, token, identity, metadata,"
            f" TIMESTAMPDIFF(MICROSECOND, {_NOW}, expires_at)"
        )
        self.read = (
            f"SELECT {columns} FROM {p} WHERE name = %(name)s AND expires_at > {_NOW} ORDER BY seq"
        )
        # The next token, or queue place, of the name (the insert id).
        self.next_token = f"UPDATE {n} SET token = LAST_INSERT_ID(token + 1) WHERE name = %(name)s"
        self.next_seq = f"UPDATE {n} SET seq = LAST_INSERT_ID(seq + 1) WHERE name = %(name)s"
        # A permit (granted 1, with its token) or a queue entry (granted 0, no token);
        # a row of the caller's (its queue entry) becomes it.
        self.grant = (
            f"INSERT INTO {p} (name, owner, weight, lim, granted, seq, token, identity,"
            " metadata, ttl, expires_at) VALUES (%(name)s, %(owner)s, %(weight)s, %(lim)s,"
            " %(granted)s, %(seq)s, %(token)s, %(identity)s, %(metadata)s, %(ttl)s,"
            f" {_EXPIRY}) ON DUPLICATE KEY UPDATE weight = %(weight)s, lim = %(lim)s,"
            " granted = %(granted)s, seq = %(seq)s, token = %(token)s,"
            " identity = %(identity)s, metadata = %(metadata)s, ttl = %(ttl)s,"
            f" expires_at = {_EXPIRY}"
        )
        self.refresh = (
            f"UPDATE {p} SET ttl = %(ttl)s, expires_at = {_EXPIRY}"
            " WHERE name = %(name)s AND owner = %(owner)s"
        )
        # Release, when nobody queued behind the permit since its grant (``waited``):
        # free the caller's live permit (of that token), one statement. Else (or if it
        # deleted nothing) the release procedure: one round trip, which answers one row
        # per grant it made ("freed", "deleted", entries left queued, then owner, token,
        # ttl; NULL if none).
        self.free = Prepared.of(
            f"DELETE FROM {p} WHERE name = %(name)s AND owner = %(owner)s AND granted = 1"
            f" AND token = %(token)s AND waited = 0 AND expires_at > {_NOW}"
        )
        self.release = f"CALL {r}(%(name)s, %(owner)s, %(token)s)"
        # Several acquires and releases of one name, in order, in one transaction (one
        # round trip): ``ops``, a JSON array (see :func:`batch_ops`). One result set per
        # acquire (as its own procedure answers it), then what the releases did and the
        # grants they made, all read before the batch's ``COMMIT`` is answered (nothing
        # is taken as granted before it is durable).
        self.batch = f"CALL {b}(%(name)s, %(ops)s)"

    def renew(self, count: int) -> str:
        """Renew ``count`` permits of one ttl: params ttl, microseconds, then a (name,
        owner, token) triple per permit."""
        return (
            f"UPDATE {self._permits} SET ttl = %s, expires_at = {_NOW} + INTERVAL %s MICROSECOND"
            f" WHERE (name, owner, token) IN ({_triples(count)}) AND granted = 1"
            f" AND expires_at > {_NOW}"
        )

    def live(self, count: int) -> str:
        """Which of ``count`` (name, owner, token) triples are live permits."""
        return (
            f"SELECT name, owner, token FROM {self._permits}"
            f" WHERE (name, owner, token) IN ({_triples(count)}) AND granted = 1"
            f" AND expires_at > {_NOW}"
        )


def batch_ops(ops: Sequence[tuple[Any, ...]]) -> str:
    """The ``ops`` of :attr:`PermitSql.batch`: an acquire as ``(owner, weight, limit,
    identity, metadata, ttl)``, a release as ``(owner, token or None)``; the texts go
    as hexadecimal (bytes whatever the connection's character set), a release's missing
    token as 0 (no token is 0)."""
    items: list[list[Any]] = []
    for op in ops:
        if len(op) == 6:
            owner, weight, limit, identity, metadata, ttl = op
            items.append(
                [
                    "a",
                    owner.encode().hex(),
                    weight,
                    limit,
                    identity.encode().hex(),
                    metadata.encode().hex(),
                    float(ttl),
                    micros(ttl),
                ]
            )
        else:
            owner, token = op
            items.append(["r", owner.encode().hex(), token or 0])
    return json.dumps(items, separators=(",", ":"))
