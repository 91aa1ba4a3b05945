"""Batched renewals: every lease renewed through one backend object, in one round trip.

Each held lease's keepalive calls ``renew`` on its own schedule. A call that finds no
usable answer starts a *batch*: one pipelined round trip that renews every lease
whose keepalive is still running. The other leases' next calls are answered from
that batch, as a session backend answers them (the grant carries the batch's send
time, :attr:`Grant.sent_at`, so the holder's deadline counts from when the batch was
sent). So N leases cost one round trip per renew interval, not N.

An answer is used only if it is:

* **newer than the lease's previous confirmation** (a batch sent before it could
  mask a later "not owner" and would not move the deadline anyway);
* **for the ttl the caller asks now**;
* **young**: sent at most ``ttl / 3`` before the call (the default renew interval; a
  batch sent after the call always qualifies, however long it took), so the
  holder's deadline keeps most of its slack.

A lease joins batches only while its keepalive asks: from its first ``renew`` call
until ``ttl / 2`` after its latest, so a lease whose owner stopped renewing is not
kept alive for long by the others' batches. Errors are never reused: a failed
batch fails each of its members' pending call once.

Asyncio-only, like the backend: times are the running loop's (which is the core's
``anyio.current_time()``, also on trio-asyncio's loop under trio).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from ..._exceptions import BackendError, BackendTimeout, NotOwnerError
from ...abc import Renewal as LeaseRenewal
from .._asyncio import now as loop_now
from .._asyncio import timeout_after

__all__ = ["Renewal", "RenewalBatcher"]

#: An answer older than this fraction of the ttl is not used.
FRESH_FRACTION = 1 / 3
#: A lease joins batches until this fraction of its ttl after its owner last asked.
KEEP_FRACTION = 1 / 2


@dataclass(eq=False)
class Renewal:
    """One lease that batches renew."""

    name: str
    owner: str
    token: int
    ttl: float
    last_call: float
    #: Sequence number of the batch that last confirmed it to its owner.
    answered: int
    result_seq: int = 0
    result_sent: float = 0.0
    result_ttl: float = 0.0
    result: bool | BaseException = False


@dataclass(eq=False)
class _Batch:
    seq: int
    sent_at: float
    members: list[Renewal]
    ttls: list[float]
    done: asyncio.Event = field(default_factory=asyncio.Event)


#: Sends one pipelined round trip: for each lease and ttl, whether it is still ours
#: (or the error for that lease).
Send = Callable[[Sequence[LeaseRenewal]], Awaitable[list[bool | BaseException]]]


class RenewalBatcher:
    """Answers ``renew`` calls from shared round trips (see the module docstring).

    :param send: runs one batch on the server
    :param timeout: seconds a batch may take before its members fail with
        :class:`BackendTimeout`
    """

    def __init__(self, send: Send, timeout: float) -> None:
        self._send = send
        self._timeout = timeout
        self._leases: dict[tuple[str, str], Renewal] = {}
        self._seq = 0
        self._inflight: _Batch | None = None
        #: Round trips sent, and renewals carried by them.
        self.batches = 0
        self.renewals = 0

    def __len__(self) -> int:
        return len(self._leases)

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> float:
        """Renew ``owner``'s lease on ``name``; return the send time of the confirming batch.

        :raises NotOwnerError: the server says ``owner`` does not hold it with ``token``
        :raises BackendError: the batch failed
        """
        now = loop_now()
        lease = self._leases.get((name, owner))
        if lease is None or lease.token != token:
            lease = Renewal(name, owner, token, ttl, now, answered=self._seq)
            self._leases[name, owner] = lease
        lease.ttl, lease.last_call = ttl, now
        # Judged against the time of this call, not of the answer: a batch that took
        # long (a loaded machine) still confirms from its send time, which is what
        # the deadline counts from; answering again from a new one could never end.
        while not self._fresh(lease, ttl, now):
            batch = self._inflight
            if batch is None:
                await self._run_batch()
            else:
                await batch.done.wait()
        return self._answer(lease)

    def counted(self, renewals: int) -> None:
        """Count a round trip of ``renewals`` sent for the core's scheduler directly
        (``Backend.renew_many``), with this batcher's own in the statistics."""
        self.batches += 1
        self.renewals += renewals

    def forget(self, name: str, owner: str) -> None:
        """Stop renewing ``owner``'s lease on ``name`` (it was released)."""
        self._leases.pop((name, owner), None)

    @staticmethod
    def _fresh(lease: Renewal, ttl: float, called: float) -> bool:
        if lease.result_seq <= lease.answered:
            return False
        if isinstance(lease.result, BaseException):
            return True  # reported once, then forgotten
        return lease.result_ttl == ttl and called - lease.result_sent <= ttl * FRESH_FRACTION

    def _answer(self, lease: Renewal) -> float:
        lease.answered = lease.result_seq
        if isinstance(lease.result, BaseException):
            raise lease.result
        if not lease.result:
            self.forget(lease.name, lease.owner)
            raise NotOwnerError(lease.name)
        return lease.result_sent

    def _members(self, now: float) -> list[Renewal]:
        stale = [k for k, v in self._leases.items() if now - v.last_call > v.ttl * KEEP_FRACTION]
        for key in stale:
            del self._leases[key]
        return list(self._leases.values())

    async def _run_batch(self) -> None:
        now = loop_now()
        self._seq += 1
        members = self._members(now)
        batch = _Batch(self._seq, now, members, [m.ttl for m in members])
        self._inflight = batch
        # Other leases wait for this round trip: the caller's cancellation must not tear
        # it down halfway (the timeout bounds it instead).
        await asyncio.shield(self._run(batch))

    async def _run(self, batch: _Batch) -> None:
        results: list[bool | BaseException] = [BackendError("the renewal batch was interrupted")]
        try:
            # Not asyncio.wait_for: up to 3.11 it can drop a cancellation (of the loop's
            # teardown, say) that comes as the replies do.
            async with timeout_after(self._timeout):
                results = await self._send(
                    [
                        (m.name, m.owner, m.token, ttl)
                        for m, ttl in zip(batch.members, batch.ttls, strict=True)
                    ]
                )
        except asyncio.TimeoutError:
            results = [BackendTimeout(f"renewal batch took over {self._timeout:g}s")]
        except BackendError as exc:
            results = [exc]
        finally:
            self._inflight = None
            self._record(batch, results)

    def _record(self, batch: _Batch, results: list[bool | BaseException]) -> None:
        if len(results) != len(batch.members):
            results = [results[0] if results else BackendError("no reply")] * len(batch.members)
        self.batches += 1
        self.renewals += len(batch.members)
        for lease, ttl, result in zip(batch.members, batch.ttls, results, strict=True):
            lease.result_seq, lease.result_sent = batch.seq, batch.sent_at
            lease.result_ttl, lease.result = ttl, result
        batch.done.set()
