"""What the PostgreSQL and MySQL / MariaDB backends share (and SQLite, the rows).

Nothing here imports a driver. :mod:`aiolease.backends.postgres` and
:mod:`aiolease.backends.mysql` keep one row per lease name::

    name | token | owner | identity | metadata | ttl | acquired_at | expires_at

A released row stays, with its owner cleared, so the token column only grows.

* :mod:`._values`: identifiers, owner ids and metadata as stored;
* :mod:`._options`: URL options and pool sizes;
* :mod:`._rows`: a stored row as a :class:`~aiolease.abc.HolderInfo` (or a
  :class:`~aiolease.ForeignDataError`);
* :mod:`._running`: statements seen to their end, driver errors mapped;
* :mod:`._pool`: the lean connection pool of a backend made from a URL;
* :mod:`._wakeups`: per-name events for ``wait_changed``;
* :mod:`._sweeps`: when to delete expired entries of a waiters table;
* :mod:`._renewals`: batched renewals, and the ``renew`` both backends answer with.
* :mod:`._permits`: permit rows read back, and the rules an acquire of a permit
  follows (semaphores and read-write locks).

Like the drivers, this runs on asyncio only (under trio the core bridges it through
trio-asyncio), so it uses :mod:`asyncio` primitives, never anyio's: anyio binds
``asyncio.get_running_loop`` when it is imported, which may be before trio-asyncio
patches it.
"""
