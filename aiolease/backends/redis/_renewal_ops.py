"""The Redis backend's renewals: :class:`RenewalOps`, the part of
:class:`~aiolease.backends.redis.RedisBackend` that renews every lease the core's
scheduler finds due (locks and permits) in one pipelined round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from ..._checked import derived
from ..._exceptions import BackendError, BackendTimeout, BackendUnavailable, NotOwnerError
from ...abc import Backend, Grant, RenewedAsAsked, RenewResult, is_permit_owner
from ...abc import Renewal as LeaseRenewal
from .._asyncio import wait_for_or_none
from ._batch import RenewalBatcher
from ._clients import Client, Replication
from ._keys import Keys
from ._permit_scripts import PERMIT_RENEW
from ._scripts import RENEW, RENEW_MANY, Script, ms

__all__ = ["RENEW_CHUNK", "RenewalOps"]

#: The most leases one RENEW_MANY script renews: the server runs nothing else
#: meanwhile (about a millisecond for 1,000), and a batch sends as many as it needs,
#: pipelined in one round trip.
RENEW_CHUNK = 1000


@dataclass(frozen=True, slots=True)
class _Plan:
    """The commands of one renewal batch: the locks' first (``sent`` of them), then
    one per permit (``permits`` of them)."""

    commands: list[tuple[Any, ...]]
    sent: int
    permits: int


class RenewalOps(Backend):
    """The renewals of a Redis backend; what they use of it is declared here and
    defined by :class:`~aiolease.backends.redis.RedisBackend`."""

    _closed: bool
    _timeout: float
    _client: Client
    _replication: Replication
    _batcher: RenewalBatcher
    #: The lease keys of the names renewed through this backend (see _lease_key).
    _lease_keys: dict[str, bytes]

    if TYPE_CHECKING:  # defined by RedisBackend (and its PermitOps)

        def _keys(self, name: str) -> Keys: ...

        def _mapped(self, name: str | None, exc: BaseException) -> BackendError: ...

        async def _call(self, name: str | None, *args: Any) -> Any: ...

        async def _pipelined(
            self, commands: Sequence[Sequence[Any]], *, guard: bool
        ) -> list[Any]: ...

        def _unreplicated(self, acked: int) -> BackendUnavailable: ...

        def _permit_renewal_commands(
            self, permits: Sequence[LeaseRenewal]
        ) -> list[tuple[Any, ...]]: ...

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        sent_at = await self._batcher.renew(name, owner, token, ttl)
        return Grant(token, ttl, sent_at=sent_at)

    async def renew_many(self, renewals: Sequence[LeaseRenewal]) -> Sequence[RenewResult]:
        """Every lease the core's scheduler finds due, in one pipelined round trip."""
        replies = await wait_for_or_none(self._send_renewals(renewals), self._timeout)
        if replies is None:
            raise BackendTimeout(f"renewal batch took over {self._timeout:g}s")
        self._batcher.counted(len(renewals))
        failed: dict[int, BackendError | NotOwnerError] = {}
        for index, reply in enumerate(replies):
            if reply is True:
                continue
            name = renewals[index][0]
            if reply is False:
                failed[index] = NotOwnerError(name)
            elif isinstance(reply, BackendError):
                failed[index] = reply
            else:
                failed[index] = BackendError(f"renewal of {name!r}: {reply!r}")
        return RenewedAsAsked(renewals, failed=failed)

    async def _send_renewals(self, leases: Sequence[LeaseRenewal]) -> list[bool | BaseException]:
        """Renew ``leases`` (locks and permits alike) in one pipelined round trip."""
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        waits = self._replication
        # One server: RENEW_MANY scripts of up to RENEW_CHUNK leases each. A Cluster
        # spreads names over slots: one RENEW script per lease. A permit: one
        # PERMIT_RENEW each, in the same pipeline.
        script = RENEW if isinstance(self._client, RedisCluster) else RENEW_MANY
        for attempt in range(2):
            # The core's list (a cohort's, tick after tick): its commands made once.
            plan = derived(leases, script.sha, self._renewal_plan_of(script))
            commands = list(plan.commands)
            if waits.replicas:
                commands.append(("WAIT", waits.replicas, waits.timeout_ms))
            try:
                replies = await self._pipelined(commands, guard=False)
            except Exception as exc:  # only the driver runs here: map all it raises
                raise self._mapped(None, exc) from exc
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
                for used in (script, PERMIT_RENEW) if plan.permits else (script,):
                    await self._call(None, "SCRIPT LOAD", used.source)
                continue
            break
        if waits.replicas:
            acked = replies.pop()
            if isinstance(acked, BaseException):
                raise self._mapped(None, acked) from acked
            if int(acked) < waits.replicas:
                raise self._unreplicated(int(acked))
        locks = len(leases) - plan.permits
        lock_replies, permit_replies = replies[: plan.sent], replies[plan.sent :]
        if script is RENEW_MANY:
            lock_replies = [
                answer
                for start, reply in zip(range(0, locks, RENEW_CHUNK), lock_replies, strict=True)
                for answer in (
                    reply if isinstance(reply, list) else [reply] * min(RENEW_CHUNK, locks - start)
                )
            ]
        if plan.permits:  # back in the order asked
            answers = iter(lock_replies), iter(permit_replies)
            replies = [next(answers[is_permit_owner(lease[1])]) for lease in leases]
        else:
            replies = lock_replies
        return [
            self._mapped(lease[0], r) if isinstance(r, BaseException) else int(r) == 1
            for lease, r in zip(leases, replies, strict=True)
        ]

    def _renewal_plan_of(self, script: Script) -> Callable[[Sequence[LeaseRenewal]], _Plan]:
        return lambda leases: self._renewal_plan(script, leases)

    def _renewal_plan(self, script: Script, leases: Sequence[LeaseRenewal]) -> _Plan:
        """The commands that renew ``leases``: the locks' (:meth:`_renewal_commands`),
        then a PERMIT_RENEW per permit."""
        locks = [lease for lease in leases if not is_permit_owner(lease[1])]
        if len(locks) == len(leases):
            commands = self._renewal_commands(script, leases)
            return _Plan(commands, len(commands), 0)
        permits = [lease for lease in leases if is_permit_owner(lease[1])]
        commands = self._renewal_commands(script, locks) if locks else []
        sent = len(commands)
        return _Plan(commands + self._permit_renewal_commands(permits), sent, len(permits))

    def _renewal_commands(
        self, script: Script, leases: Sequence[LeaseRenewal]
    ) -> list[tuple[Any, ...]]:
        """The commands that renew ``leases``: a RENEW each, or a RENEW_MANY per
        :data:`RENEW_CHUNK` of them."""
        durations = {lease[3]: 0 for lease in leases}
        for ttl in durations:
            durations[ttl] = ms(ttl)
        keys = self._lease_keys
        if script is RENEW:
            return [
                ("EVALSHA", RENEW.sha, 1, self._lease_key(name), owner, token, durations[ttl])
                for name, owner, token, ttl in leases
            ]
        commands: list[tuple[Any, ...]] = []
        for start in range(0, len(leases), RENEW_CHUNK):
            part = leases[start : start + RENEW_CHUNK]
            args: list[Any] = []
            for _, owner, token, ttl in part:
                args += (owner, token, durations[ttl])
            names = [keys.get(lease[0]) or self._lease_key(lease[0]) for lease in part]
            commands.append(("EVALSHA", RENEW_MANY.sha, len(names), *names, *args))
        return commands

    def _lease_key(self, name: str) -> bytes:
        """The lease key of ``name``, kept while it is held (renewed every tick)."""
        key = self._lease_keys.get(name)
        if key is None:
            key = self._lease_keys[name] = self._keys(name).lease
        return key
