"""The MySQL / MariaDB backend (asyncmy): lease rows judged by the server's clock.

For MySQL 8 and MariaDB 10.6+::

    mysql://user:password@host:3306/dbname
    mariadb://user@host/dbname?table=leases&poll_interval=0.25&max_size=10

or wrap an ``asyncmy`` pool you already have (it is never closed by the backend)::

    backend = MySQLBackend(pool, table="leases")

**The table.** One row per name, created by :meth:`MySQLBackend.setup` or on first
use (``CREATE TABLE IF NOT EXISTS``, which the server's metadata lock makes safe
when many processes start at once), with ``<table>_waiters``, the queue. Names,
owners and identities are ``VARBINARY``: compared byte for byte, so case, accents
and trailing spaces count, whatever the server's default collation::

    name VARBINARY(255) PRIMARY KEY, token BIGINT UNSIGNED, owner VARBINARY(255),
    identity VARBINARY(1024), metadata BLOB, ttl DOUBLE,
    acquired_at DATETIME(6), expires_at DATETIME(6), queued DATETIME(6)

(``queued``, until when waiters may be queued, is added to a table made by an older
version on first use.)

**Server time.** Expiry is ``UTC_TIMESTAMP(6)``: the same statement-start clock as
``NOW(6)``, but free of the session time zone (``NOW()`` in a ``DATETIME`` would
jump an hour at a daylight-saving change, and differ between sessions).

**Acquire is one statement.** ``INSERT ... ON DUPLICATE KEY UPDATE`` decides
atomically under the row lock. MySQL has no ``WHERE`` on that update and evaluates
its assignments left to right, each seeing the columns assigned before it, so the
token is assigned first (from the untouched row), then the owner, and every later
column asks "is the owner now the caller?". The statement reports its outcome in
the OK packet: the token column is assigned through ``LAST_INSERT_ID(expr)``, so the
reply carries the granted token, or 0 when the name is held. Only a refusal is
followed by a second statement, a plain ``SELECT`` of the holder to report (the
decision is already made; MySQL has no ``RETURNING`` for this). A row that expired
under another owner, or a free one marked ``queued``, takes a second statement too,
which gives it to the oldest live waiter: a statement that so much as names the
waiters table costs the uncontended path (about 80 µs on MariaDB), so only those do.

**Batched renewals.** All leases renewed through one backend object share one
``UPDATE`` per tick (see :class:`~aiolease.backends.sql._renewals.RenewBatcher`); its
affected-row count says when every lease of the batch was renewed, else one
``SELECT`` tells which are still the caller's and live.

**Hand-offs, across processes** (:mod:`aiolease.backends.mysql._queue`). A waiter
marks the row ``queued`` and joins the waiters table (its entry lives its own ttl
past its last refresh). A release frees a row not marked ``queued`` in one cheap
statement; else (and first, for a holder that was a waiter) it hands the row to
the oldest live entry (token + 1, the waiter's ttl, identity and metadata), or
frees it when none waits: first come, first served, the releaser asking again at
once included. A waiter leaves the
queue before its release or when it stops waiting. Within one backend object the
oldest waiter is handed the row in the release statement and answered from memory
(:mod:`aiolease.backends.mysql._turns`), if no older waiter elsewhere is ahead. While
a grant made here is live (see ``_Held``), other callers of this backend are
refused without a statement.

**Wake-ups.** MySQL has no push: each queue entry has a *bell*, a user-level lock
held while it lives, and the oldest waiter of a backend blocks in ``GET_LOCK`` on
the bell of the entry ahead of it, which that entry's release (after the hand-off)
lets go (see :mod:`aiolease.backends.mysql._bell`). Else (no bell ahead) it looks with a
plain ``SELECT``, from every 0.2 ms near the head of the queue to every
``poll_interval``; the others wake for a change made here, when the holder's ttl
runs out, or every ``poll_interval``.

**Permits** (semaphores and read-write locks: ``SEMAPHORE``, ``FAIR_PERMITS``; see
``docs/internals/semaphores.md``). Two more tables, made with the others:
``<table>_permits`` (one row per held permit or queued request, primary key
``(name, owner)``) and ``<table>_permit_names`` (per name the latest token and queue
place; never deleted). An acquire is one transaction: lock the name's row, delete
its expired permit rows, read the live ones with a locking read, then grant, queue
or refresh as :func:`aiolease.backends.sql._permits.decide` says. A release wakes
the name's permit waiters of this backend object; others look every
``poll_interval``. Renewals of permits share the locks' tick.

**Connections.** A backend made from a URL runs its statements on a lean pool of
its own (:mod:`aiolease.backends.sql._pool`), whose connections keep the fixed
statements (acquire, release, hand-off, the queue's) as server-side prepared
statements where asyncmy supports it (``stmt_cache_size``): parsed once per
connection, not per call. Its bells take connections outside the pool, opened on
first contention: one that holds them, one per wait in flight.
"""

from ._backend import MySQLBackend
from ._stats import MySQLStatistics

__all__ = ["MySQLBackend", "MySQLStatistics"]
