"""The Redis backend's permits (semaphores and read-write locks,
``docs/internals/semaphores.md``): :class:`PermitOps`, the part of
:class:`~aiolease.backends.redis.RedisBackend` that serves them over the scripts of
:mod:`aiolease.backends.redis._permit_scripts` and the keys of
:class:`~aiolease.backends.redis._keys.PermitKeys`.

Permits share the backend's transport, pub/sub connection and renewal batches with
its locks: the backend's ``release``, ``renew_many`` and ``on_taken`` hand a permit's
owner (:func:`~aiolease.abc.is_permit_owner`) to this class.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, NamedTuple

from redis.exceptions import NoScriptError

from ..._exceptions import BackendError, BackendUnavailable, LimitMismatchError
from ...abc import Backend, Grant, HolderInfo, PermitHolders
from ...abc import Renewal as LeaseRenewal
from .._asyncio import now
from ._batch import RenewalBatcher
from ._clients import Replication
from ._keys import PermitKeys, permit_keys_of
from ._permit_scripts import PERMIT_ACQUIRE, PERMIT_READ, PERMIT_RELEASE, PERMIT_RENEW
from ._pubsub import Mark, Subscriptions
from ._replies import holder_from
from ._scripts import Script, ms
from ._tickets import Turn
from ._transport import Transport

__all__ = ["PermitOps"]

#: A token no hand-off message can exceed: the waits of a replicated backend keep no
#: ticket (nor those of a reply without the name's last token).
NO_TICKET = 1 << 62
#: Refused permit requests whose pub/sub marks a backend remembers (a request that
#: never waits, as ``acquire_nowait``'s, leaves one): the oldest half is dropped.
MAX_MARKS = 1024


class Attempt(NamedTuple):
    """A refused permit request: where its name's permit channel stood before it was
    sent (``None``: not subscribed then), the name's last token when it ran (a grant
    announced with a greater one came after it), when it was sent, and what it asked."""

    mark: Mark | None
    last: int
    sent_at: float
    limit: int
    weight: int


class Ticket(NamedTuple):
    """A grant made to a waiter by a release, heard on the name's permit channel."""

    grant: Grant
    limit: int
    weight: int


class PermitOps(Backend):
    """The permit operations of a Redis backend; what they use of it is declared
    here and defined by :class:`~aiolease.backends.redis.RedisBackend`."""

    _prefix: str
    _closed: bool
    _replication: Replication
    _subscriptions: Subscriptions
    _batcher: RenewalBatcher
    _wire: Transport
    #: Refused permit requests, for :meth:`wait_permit_turn`.
    _permit_marks: dict[tuple[str, str], Attempt]
    #: Grants to waiters heard by :meth:`wait_permit_turn`, for their next attempt.
    _permit_tickets: dict[tuple[str, str], Ticket]

    if TYPE_CHECKING:  # defined by RedisBackend

        async def _eval(
            self, name: str, script: Script, keys: Sequence[bytes], *args: Any
        ) -> Any: ...

        async def _eval_waited(
            self, name: str, script: Script, keys: Sequence[bytes], *args: Any
        ) -> tuple[Any, int]: ...

        def _watching(
            self, name: str, channel: bytes | None = None
        ) -> AbstractAsyncContextManager[asyncio.Event]: ...

        def _unreplicated(self, acked: int) -> BackendUnavailable: ...

        def _mapped(self, name: str | None, exc: BaseException) -> BackendError: ...

        def _turn_timeout(self, ttl: float, seen: HolderInfo) -> float: ...

    def _permit_keys(self, name: str) -> PermitKeys:
        return permit_keys_of(self._prefix, name)

    async def try_acquire_permit(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        """One PERMIT_ACQUIRE script: granted if the held weight, the weight queued
        ahead and ``weight`` fit in ``limit``, else queued (first come, first served).
        No request if a release granted the queued request and the wait heard it (the
        same limit and weight, a ttl no longer than asked)."""
        ticket = self._permit_tickets.pop((name, owner), None) if self._permit_tickets else None
        if (
            ticket is not None
            and ticket.limit == limit
            and ticket.weight == weight
            and ticket.grant.ttl <= ttl
        ):
            return ticket.grant  # granted by a release, confirmed by its message
        keys = self._permit_keys(name)
        sent_at = now()
        mark = self._subscriptions.mark(keys.channel)  # before the attempt: see wait
        meta = json.dumps(dict(metadata), ensure_ascii=False, sort_keys=True) if metadata else "{}"
        args = (owner, ms(ttl), identity.encode(), meta.encode(), limit, weight, keys.channel)
        if not self._replication.replicas:
            reply = await self._eval(name, PERMIT_ACQUIRE, keys.all, *args)
        else:
            reply, acked = await self._eval_waited(name, PERMIT_ACQUIRE, keys.all, *args)
            if int(reply[0]) == 1 and acked < self._replication.replicas:
                await self._release_permit(name, owner, int(reply[1]))
                raise self._unreplicated(acked)
        kind = int(reply[0])
        if kind == 1:
            self._permit_marks.pop((name, owner), None)
            return Grant(int(reply[1]), ttl)
        if kind == 3:
            raise LimitMismatchError(name, limit, int(reply[1]))
        marks = self._permit_marks
        marks.pop((name, owner), None)
        last = int(reply[6]) if len(reply) > 6 else NO_TICKET
        marks[name, owner] = Attempt(mark, last, sent_at, limit, weight)
        if len(marks) > MAX_MARKS:  # abandoned requests: drop the oldest half
            for old in list(marks)[: MAX_MARKS // 2]:
                del marks[old]
        return holder_from(name, reply[:6], f"Redis key {keys.held!r}")

    def _permit_releasing(
        self, name: str, owner: str, token: int | None
    ) -> tuple[PermitKeys, tuple[Any, ...]]:
        """Forget ``owner``'s permit here; the keys and arguments of its PERMIT_RELEASE."""
        self._batcher.forget(name, owner)
        self._permit_marks.pop((name, owner), None)
        self._permit_tickets.pop((name, owner), None)
        keys = self._permit_keys(name)
        return keys, (owner, "" if token is None else token, keys.channel)

    async def _release_permit(self, name: str, owner: str, token: int | None) -> bool:
        """One PERMIT_RELEASE script: ``owner``'s permit freed, or its queue entry dropped."""
        keys, args = self._permit_releasing(name, owner, token)
        return int(await self._eval(name, PERMIT_RELEASE, keys.all, *args)) == 1

    def _permit_release_now(self, name: str, owner: str, token: int) -> Awaitable[bool] | None:
        """:meth:`_release_permit`, its script written before returning (the core's
        ``release_now``: the waiter it grants to is served sooner, and the releaser's
        bookkeeping runs while the server works); ``None`` if the transport cannot."""
        keys, args = self._permit_releasing(name, owner, token)
        sent = self._wire.batch_now([("EVALSHA", PERMIT_RELEASE.sha, 6, *keys.all, *args)])
        return None if sent is None else self._permit_released(name, sent, keys, args)

    async def _permit_released(
        self, name: str, sent: Awaitable[list[Any]], keys: PermitKeys, args: tuple[Any, ...]
    ) -> bool:
        try:
            reply = (await sent)[0]
        except Exception as exc:  # only the driver runs here: map all it raises
            raise self._mapped(name, exc) from exc
        if isinstance(reply, NoScriptError):  # (the server lost its scripts)
            reply = await self._eval(name, PERMIT_RELEASE, keys.all, *args)
        elif isinstance(reply, BaseException):
            raise self._mapped(name, reply) from reply
        return int(reply) == 1

    async def read_permits(self, name: str) -> PermitHolders | None:
        keys = self._permit_keys(name)
        reply = await self._eval(name, PERMIT_READ, keys.all, keys.channel)
        if not reply:
            return None
        place = f"Redis key {keys.held!r}"
        rows = [reply[i : i + 6] for i in range(2, len(reply), 6)]
        rows.sort(key=lambda row: int(row[2]))  # oldest grant first
        holders = tuple(holder_from(name, (0, *row[:5]), place) for row in rows)
        weights = tuple(int(row[5]) for row in rows)
        return PermitHolders(name, int(reply[0]), holders, weights, int(reply[1]))

    async def wait_permit_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Return when a release or an expiry names ``owner`` on the name's permit channel
        (its turn came: see :mod:`._permit_scripts`), when a message asks every waiter to
        look (``""``, an older aiolease's), when ``seen`` (the permit that expires first)
        expires, or after a third of ``ttl`` (the retry keeps the place). Messages naming
        other waiters do not wake it. At once if the channel was not subscribed since the
        refused attempt: the core's retry then comes with the channel subscribed."""
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        channel = self._permit_keys(name).channel
        attempt = self._permit_marks.pop((name, owner), None)
        timeout = self._turn_timeout(ttl, seen)
        async with self._watching(name, channel):
            if attempt is None or attempt.mark is None:
                return  # not listening since the attempt
            # A Turn ends on "", on its owner id, on a grant to it (kept as its ticket
            # if its token is above the attempt's last: made after the attempt ran),
            # and on a lost subscription. With replicas, no ticket: the retry is
            # answered by the script (the holder's retry), WAITed for.
            after = NO_TICKET if self._replication.replicas else attempt.last
            turn = Turn(owner, after, now() + timeout, lambda: None)
            heard = self._subscriptions.listen(channel, attempt.mark, turn.message)
            if heard is None:
                turn.cancel()
                return  # something may have been missed since the attempt: ask again
            try:
                for payload in heard[0]:
                    turn.message(payload)
                await turn.wait()
            finally:
                heard[1]()
            if turn.ticket is not None:
                token, px = turn.ticket[0], turn.ticket[1]
                # its clock starts, safely, when the attempt that queued it was sent
                grant = Grant(token, px / 1000, sent_at=attempt.sent_at)
                self._permit_tickets[name, owner] = Ticket(grant, attempt.limit, attempt.weight)

    def _permit_renewal_commands(self, permits: Sequence[LeaseRenewal]) -> list[tuple[Any, ...]]:
        """A PERMIT_RENEW of each of ``permits``."""
        return [
            ("EVALSHA", PERMIT_RENEW.sha, 6, *self._permit_keys(name).all, owner, token, ms(ttl))
            for name, owner, token, ttl in permits
        ]
