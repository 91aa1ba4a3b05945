"""The Redis backend: one Lua script per operation, push wake-ups, fair queueing, batched renewals.

URLs are redis-py's::

    redis://[[user]:password@]host[:port][/db]      rediss:// for TLS
    unix://[[user]:password@]/path/to/redis.sock[?db=0]

or for a Redis Cluster or a Sentinel-managed master (see
:mod:`aiolease.backends.redis._clients`)::

    redis+cluster://host:port[,host:port...]
    redis+sentinel://host:port[,host:port...]/service[/db]

plus ``prefix=`` (the key prefix, default ``aiolease:``), ``fair=`` (``1``, the
default, or ``0``),
``wait_replicas=``, ``wait_timeout=`` and ``transport=`` in the query or as keyword arguments, and
redis-py's own query options (``socket_timeout``, ``client_name``, ``ssl_cert_reqs``,
...). A client you already
have is used as it is, and never closed by the backend::

    backend = RedisBackend(redis.asyncio.Redis(...), prefix="myapp:locks:", fair=True)

**One round trip per operation.** Acquire, renew, release and read are each one Lua
script (:mod:`aiolease.backends.redis._scripts`), called with EVALSHA and loaded on
NOSCRIPT. Expiry is Redis's own ``PEXPIRE`` (renew resets it, never adds); the
fencing token is an ``INCR`` of a per-name counter that never expires. All keys of a
name share one hash tag, so every script stays in one Cluster slot.

**Wake-ups.** A grant or release publishes on the name's channel while the name is
watched (``wait_changed`` marks it watched for a while) or has a queue (but for fair
hand-offs nobody observes, below): a cycle nobody waits for publishes nothing. A
task in :meth:`RedisBackend.wait_changed` is woken by it, or when the holder's
remaining ttl (as the server reported it) runs out, whichever comes first.

**Fair mode** (``fair=True``, the default): a refused acquirer joins the name's queue (its entry
expires ``ttl`` after its latest attempt: a dead waiter holds nobody up longer).
Release hands the lease straight to the queue's head and tells it on the head's
backend's own *turns* channel; the waiter behind it is told how long the grant
lasts. Nobody else is woken: the hand-off goes on the name's channel only while the
name is watched (see :mod:`aiolease.backends.redis._scripts`). The waiter hears
every message since its attempt was sent. A handed-off lease lasts what is left of
the waiter's entry. Each waiter retries at least every ``ttl / 3``, when the
holder's ttl runs out (the first attempt after a crashed holder's expiry hands the
lease on), and, next in line, when a lease handed to the waiter ahead ends.

**Batched renewals.** All leases held through one backend object are renewed in one
pipelined round trip per renew interval (:mod:`aiolease.backends.redis._batch`).

**Two transports, one path.** The backend's own commands and its pub/sub go
through a transport (:mod:`aiolease.backends.redis._transport`). A backend made from a
``redis://`` or ``unix://`` URL uses a lean one: one pipelined connection with
hiredis's parser, not redis-py's client stack, which costs more CPU per command than
the loopback round trip (:mod:`aiolease.backends.redis._resp`). TLS, Cluster,
Sentinel, ``wait_replicas`` and clients passed in use redis-py's connections; the
``transport`` option (``auto``, ``lean``, ``redis-py``) chooses.

**Hand-offs without a round trip.** In fair mode the hand-off's message carries
the token and the server-side ttl of the grant, which confirms it to its waiter
(:mod:`aiolease.backends.redis._tickets`); an attempt while another task of the
backend holds the name goes in that holder's release request
(:mod:`aiolease.backends.redis._riders`). A watched channel stays subscribed a
while after its last watcher, and a watch that starts from the latest read, with no
change since, does not read again (:mod:`aiolease.backends.redis._pubsub`). A lease
granted while its channel was subscribed is watched for a takeover from the messages
the backend receives anyway: no task and no read per held lease
(:meth:`RedisBackend.on_taken`, :mod:`aiolease.backends.redis._takeover`).

**Durability.** Tokens live in Redis memory. A Redis restart without persistence
forgets the counters, and tokens start again at 1. ``DURABLE_TOKENS`` is declared
only by an instance whose single server persists every write before it answers
(``appendonly yes``, ``appendfsync always``; see :meth:`RedisBackend.detect_persistence`).
A failover to a replica that missed the latest writes can forget a counter, and a
grant: ``wait_replicas=N`` makes each grant and renewal wait (``WAIT``) until N
replicas have it, and treats a shortfall as unconfirmed.

**Cancellation.** redis-py's asyncio client may let a cancelled command complete
and return normally; the core checks for a pending cancellation after every grant
and undoes it, and the scripts make that undo (a release by owner id) safe.

Keys under the prefix that hold anything aiolease did not write raise
:class:`ForeignDataError`; they are never overwritten.

The backend is asyncio-only (``requires_asyncio``; the core bridges it under trio),
and so uses asyncio's primitives, never anyio's.
"""

from ..._exceptions import ForeignDataError
from ._backend import RedisBackend, RedisStatistics
from ._url import SCHEMES, parse_url

__all__ = ["SCHEMES", "ForeignDataError", "RedisBackend", "RedisStatistics", "parse_url"]
