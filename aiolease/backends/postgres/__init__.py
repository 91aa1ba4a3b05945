"""The PostgreSQL backend (asyncpg): lease rows judged by the server's clock, NOTIFY wake-ups.

URLs are asyncpg's (libpq's) with a few options of ours in the query; anything else
in the query goes to asyncpg (``sslmode``, or a server setting like
``application_name``)::

    postgresql://user:password@host:5432/dbname
    postgresql://host/db?table=leases&schema=app&poll_interval=0.5&max_size=10

or wrap a pool or connection you already have (it is never closed by the backend)::

    backend = PostgresBackend(pool, table="leases")

**The tables.** One row per name, created by :meth:`PostgresBackend.setup` or on first
use (``CREATE TABLE IF NOT EXISTS`` under a transaction-scoped advisory lock, so
that many processes starting at once do not trip over each other)::

    name text COLLATE "C" PRIMARY KEY, token bigint, owner text, identity text,
    metadata text, ttl float8, acquired_at timestamptz, expires_at timestamptz,
    queued_until timestamptz (the mark: waiters may be live until then; added to
    older tables by setup or on first use)

and, beside it, the queue: ``<table>_waiters`` (``aiolease_w`` and a hash where that
name would be too long), one row per refused caller that may still wait::

    name, owner (PRIMARY KEY (name, owner)), identity, metadata, ttl float8,
    ask bigint, seq bigserial (the queue's order), expires_at timestamptz

Table and schema names are validated as plain identifiers *and* always quoted;
values only ever travel as bind parameters.

**One statement per operation.** Acquire is one ``INSERT ... ON CONFLICT (name) DO
UPDATE ... WHERE <expired or ours> RETURNING``, wrapped in a statement that also
reports the holder when the name is taken, and sends ``NOTIFY`` on a new grant: on
the table's channel when it takes the name from another owner, else on the grants
channel (the channel's name and ``_g``), which a listener hears only while some wait
of its backend waits for a holder to appear (``wait_changed(name, None)``, as
``observe()`` does), so that holders are not woken by every grant of a free name.
Every notification carries its token (see
:func:`~aiolease.backends.postgres._statements.parse_payload`).
``clock_timestamp()`` decides expiry, read once per statement; a retry by the
current owner keeps its token, identity and metadata and resets the expiry, and any
other grant increments the token. Release clears the owner and keeps the row (and
its token), and sends ``NOTIFY``. A refusal whose holder is not yet visible to the
statement's snapshot (a concurrent first grant) is asked again.

**A queue in the database** (``FAIR_QUEUE``, across processes). A refused acquire
writes its caller's waiter row in the same statement (its place, ``seq``, is kept
while it asks again before the row expires, its own ttl after each ask: a waiter
that died holds nobody up for longer). A free or expired name is granted only to a
caller that no live waiter is queued before, so a newcomer queues behind those
waiting. A release hands the row to the oldest live waiter in the release statement
itself (token + 1, that waiter's identity, metadata and ttl, until its own ttl from
the release or its row's expiry, whichever is sooner) and announces it (``'h'``,
with how long that grant lasts at most: the other waiters ask again once it runs
out, so a waiter that died while queued holds them up for no longer than its own
ttl), else clears it. The waiter, in any process, takes the grant from the notification
without a statement (:mod:`aiolease.backends.postgres._queue`): its local deadline counts
from the send time of the ask whose row the release saw, which ran before the
release read its clock. A waiter asks again a third of its ttl after its latest
refusal, when the holder's ttl runs out, and after a release with nobody to hand
to. A waiter that stops (cancelled, timed out, or refused by ``acquire_nowait``) is
released by the core with its owner id: that deletes its row (also one written by an
ask whose refusal it never saw) and gives back a hand-off it may have got; expired
rows of dead waiters are swept (see ``Sweeps``); a hand-off and a waiter that leaves
at the same moment are told apart by the waiter rows each statement deleted, and the
grant given back.
Every statement locks the lease row before waiter rows, so none can deadlock.
A refusal marks the lease row (``queued_until``, at least its waiter row's expiry),
so the uncontended acquire and release touch the lease table only: they grant and
free only a row that is not marked (checked again on the newest row version), and
leave a marked one to the queue-aware statements, whose release clears the mark
when nobody is left to hand to.

**Batched renewals.** All leases renewed through one backend object share one
``UPDATE ... FROM unnest(...)`` per tick (see
:class:`~aiolease.backends.sql._renewals.RenewBatcher`); a renew answered from a
statement sent for the batch says so in ``Grant.sent_at``.

**Wake-ups.** One listening connection per backend object (opened with a backend
made from a URL, else on the first ``wait_changed``) receives ``NOTIFY`` on release,
hand-off and takeover and wakes the waiting tasks: watchers on any change, a waiter
on a hand-off to it or a release. Expiry sends nothing: a waiter also wakes when the
holder's remaining ttl runs out. If the listening connection drops, every waiter
wakes, waiting falls back to polling every ``poll_interval`` (a read: is the name
free, or ours?, never later than the holder's expiry), and the next wait reconnects.
While it is up, held leases are watched by callback (:meth:`PostgresBackend.on_taken`),
without a task per lease. Grants of a free name, and releases nobody queued for, are
announced only on an observers' channel, and only for rows that a wait for a holder
to appear marked watched (``watched_until``): an uncontended cycle notifies nobody.

**Connections.** A backend made from a URL runs its statements on a lean pool of
its own (:mod:`aiolease.backends.sql._pool`: no per-statement timers, proxies or
reset round trip); one passed in is used as it is.

**Hand-offs.** A release hands the name to the oldest waiter of any process (see
above); one through the same backend object learns it from the release's own
reply, before the notification. ``read`` of a live lease held through the backend
is answered without a statement while the listener proves the row unchanged (see
``Held``). All statements but the renewal use at most all but one of the pool's
connections, so a burst of acquires never starves renewals.

**Permits** (semaphores and read-write locks: ``SEMAPHORE``, ``FAIR_PERMITS``; see
``docs/internals/semaphores.md``). Two more tables, made with the others:
``<table>_permits`` (one row per held permit or queued request, keyed ``(name,
owner)``, with its weight, limit, place ``seq``, token, identity, metadata, ttl and
expiry) and ``<table>_permit_names`` (per name the latest token and queue place;
never deleted). An acquire is one transaction: lock the name's row, read the live
rows (deleting the expired ones), then grant, queue or refresh as
:func:`aiolease.backends.sql._permits.decide` says. A release deletes the row and
sends ``NOTIFY`` (``p:<name>``), which wakes the name's permit waiters in every
process. Renewals of permits share the locks' tick (one statement per table).

**Poolers.** Correctness needs no session state, so the lease statements work
through PgBouncer in transaction mode: give ``pooler=transaction``, which turns
asyncpg's named prepared statements off (``statement_cache_size=0``, unless given)
and never sends ``LISTEN`` through the pooler, where it would hear nothing. Waiters
then poll every ``poll_interval``, or, with ``listen_url`` pointing at the server
directly (or at a session-mode pool), are woken by ``NOTIFY`` as usual.
"""

from ._backend import WATCH_FOR, PostgresBackend, PostgresStatistics
from ._errors import map_error
from ._listener import LISTEN_CHECK

__all__ = ["LISTEN_CHECK", "WATCH_FOR", "PostgresBackend", "PostgresStatistics", "map_error"]
