"""When a backend object deletes the expired entries of its waiters table."""

from __future__ import annotations

import math

from .._asyncio import now

__all__ = ["SWEEP_AFTER", "SWEEP_EVERY", "SWEEP_LIMIT", "Sweeps"]

#: A backend object deletes expired entries of its waiters table (PostgreSQL, MySQL)
#: at most this often: its first wait in a queue does, then one every so often.
SWEEP_EVERY = 60.0
#: Entries that expired at least this long ago are deleted (one that just expired may
#: still be read by a statement in flight), ...
SWEEP_AFTER = 1.0
#: ... at most this many per sweep.
SWEEP_LIMIT = 1000


class Sweeps:
    """When a backend object next sweeps its waiters table of expired entries.

    Entries of waiters that died (or were cut off past :data:`FINISH_GRACE`) expire
    but are never deleted by their owners, and a name nobody queues for again has no
    statement that deletes them: the sweeps keep the table to its live entries and
    those of the last :data:`SWEEP_EVERY` seconds.
    """

    def __init__(self, every: float = SWEEP_EVERY) -> None:
        self._every = every
        self._next = -math.inf

    def due(self) -> bool:
        """Whether to sweep now (then not again for :data:`SWEEP_EVERY` seconds)."""
        at = now()
        if at < self._next:
            return False
        self._next = at + self._every
        return True
