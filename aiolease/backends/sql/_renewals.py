"""Batched renewals: every lease of one backend renewed in one statement per tick.

Also the ``renew`` that the PostgreSQL and MySQL backends both answer with
(:func:`renew_held`), and what each keeps of a grant made through it (:class:`Held`).
"""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ..._checked import derived
from ..._exceptions import NotOwnerError
from ...abc import Grant, Renewal, RenewedAsAsked
from .._asyncio import now

__all__ = [
    "Held",
    "Key",
    "RenewBatcher",
    "Renewed",
    "SendBatch",
    "SendMany",
    "renew_held",
    "renew_many_held",
]

#: A lease as the renewal batcher knows it: (name, owner, token).
Key = tuple[str, str, int]

#: A renewal is answered from an earlier statement only if that statement's age plus
#: the lease's longest gap between renew calls stays within this share of the ttl, so
#: the next renewal comes well before the confirmation runs out (the core's margin
#: defaults to a tenth of the ttl).
SHARE_BUDGET = 0.75


@dataclass
class _Renewal:
    """One lease renewed through this backend."""

    ttl: float
    last_call: float
    #: The longest gap seen between two renew calls for it.
    interval: float = 0.0
    #: When the newest statement that renewed it was sent.
    confirmed: float | None = None
    #: The newest confirmation already handed to the caller.
    answered: float = -math.inf


@dataclass
class _Batch:
    items: dict[Key, float] = field(default_factory=dict)
    sending: bool = False
    sent_at: float | None = None
    renewed: frozenset[Key] = frozenset()
    error: Exception | None = None
    cancelled: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


#: Renews ``[(key, ttl), ...]`` in one statement; returns the keys it renewed.
SendBatch = Callable[[Sequence[tuple[Key, float]]], Awaitable[frozenset[Key]]]


class RenewBatcher:
    """Renewals of every lease held through one backend, in one statement per tick.

    A renew call joins the batch that has not been sent yet; its first caller sends it
    once the renew statement in flight (at most one at a time) has returned, so the
    calls that arrive meanwhile share the next statement. Every statement also renews
    the other leases whose holders are still renewing (they asked within half a ttl)
    and that were last renewed more than a sixth of a ttl ago. A later renew call for
    such a lease is answered from that statement, with ``sent_at`` = the time it was
    sent, but only when the statement is newer than the confirmation the caller had
    before (never older), and fresh enough (see :data:`SHARE_BUDGET`). A lease whose
    holder stopped renewing drops out, and a released one at once.

    :param send: renews a batch in one statement
    :param window: seconds the first caller of a batch waits for others to join
    """

    def __init__(self, send: SendBatch, *, window: float = 0.0) -> None:
        self._send_batch = send
        self._window = window
        self._renewals: dict[Key, _Renewal] = {}
        self._open: _Batch | None = None
        self._inflight: _Batch | None = None
        #: Statements sent, and renew calls answered from a statement sent for others.
        self.statements = 0
        self.shared = 0

    def forget(self, name: str, owner: str, token: int | None) -> None:
        """Stop renewing ``owner``'s grant of ``name`` (it was released; any token if ``None``)."""
        if token is not None:
            self._renewals.pop((name, owner, token), None)
            return
        for key in [k for k in self._renewals if k[0] == name and k[1] == owner]:
            del self._renewals[key]

    async def renew(self, key: Key, ttl: float) -> float | None:
        """Renew ``key`` for ``ttl`` seconds.

        :returns: :func:`now` when the confirming statement was sent, or
            ``None`` when the server did not renew it (not the owner any more)
        :raises Exception: what the batch's statement raised (a mapped backend error)
        """
        called = now()
        renewal = self._called(key, ttl, called)
        if self._shareable(renewal, called):
            await asyncio.sleep(0)
            self.shared += 1
            return self._answer(renewal, renewal.confirmed)
        inflight = self._inflight
        if inflight is not None and self._covers(inflight, key, ttl, renewal):
            await inflight.done.wait()
            if not (inflight.error or inflight.cancelled):
                self.shared += 1
                return self._answer(renewal, inflight.sent_at if key in inflight.renewed else None)
        return await self._join(key, ttl, renewal)

    def _called(self, key: Key, ttl: float, at: float) -> _Renewal:
        renewal = self._renewals.get(key)
        if renewal is None or renewal.ttl != ttl:
            renewal = self._renewals[key] = _Renewal(ttl, at)
        else:
            renewal.interval = max(renewal.interval, at - renewal.last_call)
            renewal.last_call = at
        return renewal

    @staticmethod
    def _shareable(renewal: _Renewal, at: float) -> bool:
        confirmed = renewal.confirmed
        return (
            confirmed is not None
            and confirmed > renewal.answered
            and renewal.interval > 0
            and (at - confirmed) + renewal.interval <= SHARE_BUDGET * renewal.ttl
        )

    @staticmethod
    def _covers(batch: _Batch, key: Key, ttl: float, renewal: _Renewal) -> bool:
        sent = batch.sent_at
        return batch.items.get(key) == ttl and sent is not None and sent > renewal.answered

    def _answer(self, renewal: _Renewal, sent_at: float | None) -> float | None:
        if sent_at is not None:
            renewal.answered = max(renewal.answered, sent_at)
        return sent_at

    async def _join(self, key: Key, ttl: float, renewal: _Renewal) -> float | None:
        while True:
            batch = self._open
            if batch is None:
                batch = self._open = _Batch()
            if batch.items.get(key, ttl) != ttl:
                await batch.done.wait()  # one ttl per lease per statement
                continue
            batch.items[key] = ttl
            if batch.sending:
                await batch.done.wait()
            else:
                batch.sending = True
                await self._send(batch)
            if batch.cancelled:
                continue  # its sender was cancelled: send it again (renewal is idempotent)
            if batch.error is not None:
                raise copy.copy(batch.error) from batch.error.__cause__
            return self._answer(renewal, batch.sent_at if key in batch.renewed else None)

    async def _send(self, batch: _Batch) -> None:
        try:
            await asyncio.sleep(self._window)  # at least a checkpoint: let callers join
            while self._inflight is not None:  # one renew statement in flight at a time
                await self._inflight.done.wait()
            if self._open is batch:
                self._open = None
            sent_at = now()
            self._add_due(batch, sent_at)
            self._inflight = batch
            batch.sent_at = sent_at
            self.statements += 1
            batch.renewed = await self._send_batch(list(batch.items.items()))
            self._record(batch)
        except Exception as exc:
            batch.error = exc
            raise
        except BaseException:
            batch.cancelled = True
            raise
        finally:
            if self._open is batch:
                self._open = None
            if self._inflight is batch:
                self._inflight = None
            batch.done.set()

    def _add_due(self, batch: _Batch, at: float) -> None:
        for key, renewal in list(self._renewals.items()):
            if at - renewal.last_call > renewal.ttl:
                del self._renewals[key]  # its holder stopped renewing
            elif key not in batch.items and self._due(renewal, at):
                batch.items[key] = renewal.ttl

    @staticmethod
    def _due(renewal: _Renewal, at: float) -> bool:
        confirmed = renewal.confirmed
        still_renewing = at - renewal.last_call < renewal.ttl / 2
        return still_renewing and confirmed is not None and at - confirmed >= renewal.ttl / 6

    def _record(self, batch: _Batch) -> None:
        assert batch.sent_at is not None
        for key, ttl in batch.items.items():
            renewal = self._renewals.get(key)
            if renewal is None or renewal.ttl != ttl:
                continue
            if key in batch.renewed:
                renewal.confirmed = max(renewal.confirmed or batch.sent_at, batch.sent_at)
            else:
                del self._renewals[key]


class Renewed:
    """When the newest statement that renewed one list of the core's
    (:class:`~aiolease._checked.HeldRenewals`, tick after tick) was sent: one time for
    all the grants that list renews, so that a tick updates no grant of its own."""

    __slots__ = ("sent_at",)

    def __init__(self) -> None:
        self.sent_at = -math.inf


@dataclass(slots=True)
class Held:
    """A grant made through a backend, as it knows it without a statement.

    The row stays ``owner``'s at least until ``sent_at + ttl``: ``sent_at`` is when the
    newest statement that granted or renewed it was sent (before the server read its
    clock): its own ``own_sent_at``, or that of the list of renewals it rides on
    (``batch``), whichever is later. Each backend adds what it answers from it (see
    its ``Held``).
    """

    owner: str
    token: int
    identity: str
    meta: str
    ttl: float
    own_sent_at: float
    batch: Renewed | None = field(default=None, kw_only=True)

    @property
    def sent_at(self) -> float:
        batch = self.batch
        if batch is None or batch.sent_at < self.own_sent_at:
            return self.own_sent_at
        return batch.sent_at

    @sent_at.setter
    def sent_at(self, value: float) -> None:
        self.own_sent_at = value

    def ride(self, batch: Renewed | None) -> None:
        """From now on, take the send times of ``batch``'s statements (``None``: none)."""
        self.own_sent_at = self.sent_at
        self.batch = batch


H = TypeVar("H", bound=Held)


def _keep(held: dict[str, H], name: str, owner: str, token: int, renewed: bool) -> H | None:
    """Keep ``held``'s grant of ``name`` in step with a renewal's outcome; the grant if
    it is ``owner``'s ``token``."""
    known = held.get(name)
    if known is None or known.owner != owner or known.token != token:
        return None
    if not renewed:
        del held[name]
    return known


#: Renews every lease of a batch in one statement (at most a few); the keys of those
#: it did not renew (usually none).
SendMany = Callable[[Sequence[Renewal]], Awaitable[set[Key]]]


def _all_live(renewals: Sequence[Renewal]) -> bool:
    return all(token >= 1 for _, _, token, _ in renewals)


def _ride(held: dict[str, H], renewals: Sequence[Renewal]) -> tuple[Renewed, list[tuple[H, float]]]:
    """The send time of ``renewals``' statements, which every grant of ``held`` that
    they renew with its own ttl takes from now on; and the grants they renew with
    another ttl (rare), each with that ttl, to be kept in step one by one."""
    batch = Renewed()
    others: list[tuple[H, float]] = []
    get = held.get
    for name, owner, token, ttl in renewals:
        known = get(name)
        if known is not None and known.owner == owner and known.token == token:
            if known.ttl == ttl:
                known.ride(batch)
            else:
                others.append((known, ttl))
    return batch, others


async def renew_many_held(
    batcher: RenewBatcher, send: SendMany, held: dict[str, H], renewals: Sequence[Renewal]
) -> RenewedAsAsked:
    """:meth:`Backend.renew_many`: every renewal in one statement (``send``, counted as
    ``batcher``'s), ``held`` kept in step as :func:`renew_held` keeps it. (A token
    below 1 is nobody's: it is not sent.) ``send`` gets ``renewals`` itself when it
    sends them all (the usual case), so that it may keep what it derives from the
    core's list (:func:`~aiolease._checked.derived`)."""
    sent_at = now()
    batch, others = derived(renewals, "sql-held", lambda renewals: _ride(held, renewals))
    if derived(renewals, "sql-live", _all_live):
        due: Sequence[Renewal] = renewals
        not_renewed: set[Key] = set()
    else:
        due = [r for r in renewals if r[2] >= 1]
        not_renewed = {(n, o, t) for n, o, t, _ in renewals if t < 1}
    if due:
        batcher.statements += 1
        not_renewed |= await send(due)
    if sent_at > batch.sent_at:  # (those not renewed are dropped from ``held`` below)
        batch.sent_at = sent_at
    if not not_renewed:  # the usual answer: no grant to update but those of another ttl
        for other, ttl in others:
            other.ttl = ttl
            if sent_at > other.sent_at:
                other.sent_at = sent_at
        return RenewedAsAsked(renewals, sent_at)
    failed: dict[int, NotOwnerError] = {}
    get = held.get
    for index, (name, owner, token, ttl) in enumerate(renewals):
        known = get(name)
        if known is not None and (known.owner != owner or known.token != token):
            known = None
        if not_renewed and (name, owner, token) in not_renewed:
            if known is not None:
                del held[name]
            failed[index] = NotOwnerError(name)
        elif known is not None:
            known.ttl = ttl
            if sent_at > known.sent_at:
                known.sent_at = sent_at
    return RenewedAsAsked(renewals, sent_at, failed)


async def renew_held(
    batcher: RenewBatcher, held: dict[str, H], name: str, owner: str, token: int, ttl: float
) -> Grant:
    """Renew ``owner``'s grant ``token`` of ``name`` through ``batcher``, and keep what
    ``held`` knows of it in step: a renewed grant lasts ``ttl`` from the statement's
    send time; one found gone is forgotten. (A token below 1 is nobody's: no row holds
    one, so no statement is sent for it.)

    :raises NotOwnerError: the grant is not ``owner``'s, or not live, any more
    """
    sent_at = None if token < 1 else await batcher.renew((name, owner, token), float(ttl))
    known = _keep(held, name, owner, token, sent_at is not None)
    if sent_at is None:
        raise NotOwnerError(name)
    if known is not None:
        known.ride(None)  # (its ttl may change: no batch's statement speaks for it now)
        known.ttl, known.sent_at = float(ttl), max(known.sent_at, sent_at)
    return Grant(token, ttl, sent_at=sent_at)
