"""Redlock: leases over N independent Redis servers, granted by a majority.

::

    redis+redlock://host:port,host:port,host:port[/db]     rediss+redlock:// for TLS

or ``RedlockBackend([client_a, client_b, client_c])`` with ``redis.asyncio.Redis``
clients you own (the backend never closes them). Use an odd number of servers,
3 or 5, that fail independently (no replication between them).

**The algorithm** (redis.io, "Distributed Locks with Redis"). An acquire runs the
same Lua script on every instance at once and waits for every answer, each request
bounded by a timeout much smaller than the ttl (``request_timeout``, at most a
fifth of the ttl, but at least 50 ms or the whole validity of a shorter ttl). It is
granted only if a majority granted it *and* its validity ``ttl - elapsed - drift``
is positive, where ``elapsed`` runs from just before the first request was sent
and ``drift = ttl * drift_factor + drift_floor`` (0.01 and 2 ms by default). The
grant handed to the core lasts ``ttl - drift`` from that send time, so the holder's
local deadline (``ttl - drift - margin``) falls before the validity ends. A failed
acquire releases on *every* instance, also those that did not answer, and a grant
that arrives after the caller gave up is released on its instance as it arrives.
A renewal must be confirmed by a majority within its timeout; a majority that says
"not yours" ends the lease (:class:`NotOwnerError`), anything else is a transient
error the keepalive retries until the local deadline. Release runs on every
instance; :meth:`read` reports the holder that a majority agrees on, or ``None``.

**What it guarantees.** While fewer than half of the instances fail, and each
instance's clock runs at about the rate of the client's (the drift allowance), at
most one client at a time holds a valid lease, and the holder's work is cancelled
at its local deadline, before the name can be granted again. Losing a minority of
instances does not stop acquire, renew or release.

**What it does not guarantee** (Martin Kleppmann, "How to do distributed
locking"; the answer to it is honesty, not denial):

* *Tokens are per instance, not a global fence.* Each instance keeps its own
  counter; a grant gets the highest of its quorum, and renew and release raise
  the counters of every instance they reach to it, so in the absence of faults
  each client sees tokens increase. But an instance that restarts without
  persistence forgets its counter (and its leases), and two majorities can then
  hand out the same or a lower token. Do not use these tokens as the fence of a
  resource that must reject stale writers; ``DURABLE_TOKENS`` is not declared.
* *Expiry trusts every instance's clock.* Redis expires keys on its wall clock: a
  clock that jumps forward on one instance of a majority frees the lease early
  there, and another client can then win a majority while the first still holds.
* *A restarted instance must stay down for a ttl* (a "delayed restart"), or keep
  an fsynced append-only file; otherwise it comes back empty and can be part of a
  second majority at once.
* *Process pauses* longer than the margin are caught by the local deadline only
  when the process runs again: as with every lease, work that does not check its
  cancellation can overlap.

When these matter, use the one-server Redis backend on a server with an fsynced
append-only file (``DURABLE_TOKENS``), with ``wait_replicas`` for failover, or
etcd, whose revisions are a real global fence.

Waiters wake on a grant or release published by any instance, or when the
holder's remaining ttl runs out. There is no fair queue (``fair=True`` is refused);
a waiter that lost a split vote (no client won a majority) waits for a change or
the first refusing holder's expiry, then retries after a random delay, as Redlock
prescribes. The backend is asyncio-only (the core bridges it
under trio).
"""

from ._backend import RedlockBackend
from ._url import SCHEMES

__all__ = ["SCHEMES", "RedlockBackend"]
