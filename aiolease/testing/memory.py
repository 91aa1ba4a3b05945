"""A memory backend for an application's own tests: the test drives its clock, and
makes a held lease be lost on demand, without a server.

::

    backend = DrivenMemoryBackend()
    ...                                    # the application holds leases through it
    backend.advance(3600)                  # an hour passes on the "server"
    backend.lose("invoices/42")            # the holder's block is cancelled:
                                           # LeaseLostError(STOLEN), as for a real loss

The core keeps its local deadlines on the event loop's monotonic clock, which a test
under asyncio cannot move; so :meth:`DrivenMemoryBackend.advance` moves the
backend's clock only, and keeps the two consistent as the time would have: a lease
held in a block (``async with lock``, an elector's term) is renewed by the core, so
it lives through the time that passed (its record is moved along with the clock);
any other grant ages by that time: its record expires if its ttl runs out (waiters
wake up and may take the name), and a lease from ``acquire()`` that nobody renewed
meanwhile loses that time from its local deadline too, so it ends
(:attr:`LossReason.EXPIRED`) exactly when its record does. The time counts towards
every held lease's ``max_hold`` and ``min_hold`` too. Under trio, a
``MockClock`` moves the event loop's clock and this backend's together, as it does
for :class:`~aiolease.backends.memory.MemoryBackend`.
"""

from __future__ import annotations

from .._clock import current_time
from .._exceptions import InvalidArgument, LossReason
from .._life import Tenancy
from .._limits import age
from .._validate import check_seconds
from ..backends.memory import MemoryBackend

__all__ = ["DrivenMemoryBackend"]


class DrivenMemoryBackend(MemoryBackend):
    """A :class:`~aiolease.backends.memory.MemoryBackend` whose clock the test moves
    forward (:meth:`advance`), and whose held leases the test can make be lost
    (:meth:`lose`). Its clock is the core's plus :attr:`offset`."""

    def __init__(self) -> None:
        self._offset = 0.0
        super().__init__(clock=self._now)

    def __repr__(self) -> str:
        return f"<DrivenMemoryBackend +{self._offset:g}s {len(self._records)} records>"

    def _now(self) -> float:
        return current_time() + self._offset

    @property
    def offset(self) -> float:
        """How far :meth:`advance` moved this backend's clock so far, in seconds."""
        return self._offset

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass on this backend at once, as if the test had waited them
        while the core renewed every lease held in a block through this backend on time
        (see the module docstring). Grants that nobody renews expire when their time
        runs out: waiters wake up, and a lease from ``acquire()`` ends
        (:attr:`LossReason.EXPIRED`) when its record does.

        :raises InvalidArgument: ``seconds`` is negative, or not a finite number
        """
        seconds = check_seconds("seconds", seconds, allow_zero=True)
        tenancy = Tenancy.of(self)
        renewed = {
            (lease.name, lease.owner)
            for entries in tenancy.blocks.values()
            for _, lease in entries
            if lease.lost is None
        }
        self._offset += seconds
        for name, record in list(self._records.items()):
            if (name, record.owner) in renewed:
                record.expires_at += seconds
            else:
                self._live(name)  # drops it if its time ran out, and tells who waits
        now = current_time()
        for lease in list(tenancy.leases):
            age(lease, seconds)  # its max_hold and min_hold come that much closer
            if (lease.name, lease.owner) not in renewed and lease.lost is None:
                # Nobody renewed it meanwhile: the time passed for its deadline too.
                lease._deadline -= seconds
                lease._renew_at -= seconds
                lease._lost_at(now)
        for name in list(self._changed):
            self._notify(name)  # waiters sleep by the old clock: let them look again

    def lose(self, name: str, reason: LossReason = LossReason.STOLEN) -> None:
        """Make every lease of ``name`` held through this backend be lost now with
        ``reason``, as a real loss would: a block holding it is cancelled and raises
        :class:`~aiolease.LeaseLostError` (``lease.lost`` says ``reason``; an elector's
        ``on_defeated`` is called, and ``run`` campaigns again). With
        :attr:`LossReason.STOLEN`, the record is dropped too, as a takeover would leave
        it: another holder may take the name at once. With any other reason the record
        stays until the holder releases it (as it does when it leaves its block).

        :raises InvalidArgument: ``reason`` is :attr:`LossReason.RELEASED` (a release is
            not a loss: release the lease instead)
        :raises LookupError: no lease of ``name`` is held through this backend
        """
        if not isinstance(reason, LossReason) or reason is LossReason.RELEASED:
            raise InvalidArgument(
                f"reason must be a LossReason other than RELEASED, got {reason!r}"
            )
        leases = [
            lease for lease in Tenancy.of(self).leases if lease.name == name and lease.lost is None
        ]
        if not leases:
            raise LookupError(f"no lease of {name!r} is held through {self!r}")
        if reason is LossReason.STOLEN:
            self.force_release(name)  # a block watching the name learns of it at once
        for lease in leases:
            lease._end(reason)
