"""The MongoDB backend (pymongo's asyncio client): one atomic upsert judged on the
server's clock, durable fencing tokens, change-stream wake-ups, a fair queue.

URLs are pymongo's, with a few options of ours in the query (anything else goes to
pymongo)::

    mongodb://user:password@db1,db2,db3/app?replicaSet=rs0
    mongodb+srv://cluster.example.com/app?collection=leases&fair=0&w=majority

or wrap a client you already have (never closed by the backend)::

    backend = MongoBackend(AsyncMongoClient(...), database="app", collection="leases")

**The document.** One per lease name, never deleted: ``{_id: name, token, owner,
identity, metadata, acquired, expires, released, queue}``. A grant is one
``findAndModify`` upsert whose update pipeline decides with ``$$NOW``
(:mod:`~aiolease.backends.mongo._pipelines`); the token is incremented by every
grant to a new owner and kept by releases, which unset the owner's fields only.

**Consistency.** Majority write and read concern, primary reads, whatever the
client's defaults; ``w=1`` can be asked for, and then ``DURABLE_TOKENS`` is not
declared. Grants and releases are plain commands (not retryable writes, which cost
the server a session record per write), sent once more after a failover: each is
idempotent for its sender (:mod:`~aiolease.backends.mongo._writes`).

**Renewals** of every lease held through one backend object: one unordered
``bulk_write`` per tick.

**Wake-ups.** One change stream per backend object
(:mod:`~aiolease.backends.mongo._stream`) on replica sets and sharded clusters; a
standalone server has none (error 40573), and waiters sleep until the holder's
remaining ttl runs out.

**Fair queue** (``fair=1``, the default): the waiters live in the lease document; a
release hands the lease to the first live one on the server, and only that waiter
is woken (:mod:`~aiolease.backends.mongo._turns`).

**Permits** (semaphores, read-write locks): one document per name in
``<collection>_permits``, each acquire one ``findAndModify`` upsert deciding on the
server (:mod:`~aiolease.backends.mongo._permits`, served by
:mod:`~aiolease.backends.mongo._permit_ops`).

See ``docs/backends/mongo.md`` and ``docs/internals/mongo.md``.
"""

from ._backend import MongoBackend, MongoStatistics

__all__ = ["MongoBackend", "MongoStatistics"]
