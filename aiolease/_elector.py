"""Elector: leader election with terms, health-based step-down and observation."""

from __future__ import annotations

import inspect
import logging
import random
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import Any, TypeVar, cast, final

import anyio

from ._acquire import acquire_lease, default_identity, validate_backend
from ._bridge import adapt
from ._clock import move_on_after
from ._exceptions import (
    BackendError,
    LeaseLostError,
    LossReason,
    NotOwnerError,
    UnsupportedCapability,
)
from ._holding import Counters, HealthCheck, HealthPolicy, Holding, probe
from ._lease import Lease, Timing, log_fields
from ._limits import HoldLimits
from ._records import state_of
from ._validate import check_count, check_identity, check_metadata, check_name, check_seconds
from .abc import Backend, Capability, HolderInfo

logger = logging.getLogger("aiolease.elector")

T = TypeVar("T")

_NOTHING: Any = object()


@final
@dataclass(frozen=True)
class LeaderInfo:
    """Who leads, as an observer sees it.

    :param identity: the leader's identity
    :param token: the fencing token of its term
    :param metadata: what the leader published with its term, or proclaimed since
        (:meth:`Elector.proclaim`)
    :param remaining: seconds of server-side ttl the term had left when read, where the
        backend knows it (``None`` otherwise); not compared: two reads of one term at
        different times are equal
    """

    identity: str
    token: int
    metadata: Mapping[str, str]
    remaining: float | None = field(default=None, compare=False)

    @classmethod
    def _from_holder(cls, holder: HolderInfo) -> LeaderInfo:
        return cls(
            holder.identity,
            holder.token,
            MappingProxyType(dict(holder.metadata)),
            holder.remaining,
        )


@final
@dataclass(frozen=True)
class ElectorStatistics:
    """A snapshot of one :class:`Elector`'s activity.

    :param name: the election name
    :param identity: this candidate's identity
    :param is_leader: whether a term is running now
    :param token: the current term's token, if leading
    :param terms: terms won
    :param renewals: confirmed renewals
    :param renew_failures: renewals that failed and were retried
    :param losses: terms that ended by loss, by reason
    :param campaign_errors: backend errors while campaigning
    """

    name: str
    identity: str
    is_leader: bool
    token: int | None
    terms: int
    renewals: int
    renew_failures: int
    losses: Mapping[LossReason, int]
    campaign_errors: int


async def _call_back(callback: Callable[..., Any] | None, *args: Any) -> None:
    if callback is not None:
        result = callback(*args)
        if inspect.isawaitable(result):
            await result


@final
class Elector:
    """A candidate in the election for ``name``.

    :param backend: where the election lives
    :param name: the election name (a lease name)
    :param ttl: seconds a silent leader keeps the lease
    :param identity: this candidate's identity, shown to observers (default ``host:pid``)
    :param metadata: a small ``str -> str`` map published with each term
    :param renew_interval: seconds between renewals (default ``ttl / 3``)
    :param margin: see :class:`AsyncLock`
    :param health: a sync or async callable returning truthy when this candidate
        is fit to lead; an exception or a timeout counts as a failure
    :param health_interval: seconds between probes (default ``renew_interval``)
    :param health_failures: consecutive failures that make the leader step down
    :param health_timeout: seconds one probe may take (default ``health_interval``)
    :param retry_backoff: mean seconds to wait before campaigning again after a
        term ends or the backend fails (jittered by +-50 %)
    :param on_elected: called with the lease when a term starts (sync or async)
    :param on_defeated: called with the :class:`LossReason` as soon as a term is lost
        (the work cancelled), before the lost lease's release
    :param max_hold: seconds (or a :class:`~datetime.timedelta`) a term may last: then
        the leader steps down (:attr:`LossReason.MAX_HOLD`); :meth:`run` campaigns again
        after a ttl, so that the other candidates have had their chance
    :raises InvalidArgument: on any bad argument
    """

    def __init__(
        self,
        backend: Backend,
        name: str,
        *,
        ttl: float,
        identity: str | None = None,
        metadata: Mapping[str, str] | None = None,
        renew_interval: float | None = None,
        margin: float | None = None,
        release_timeout: float | None = None,
        health: HealthCheck | None = None,
        health_interval: float | None = None,
        health_failures: int = 3,
        health_timeout: float | None = None,
        retry_backoff: float | None = None,
        on_elected: Callable[[Lease], Awaitable[None] | None] | None = None,
        on_defeated: Callable[[LossReason], Awaitable[None] | None] | None = None,
        max_hold: float | timedelta | None = None,
    ) -> None:
        self._backend = validate_backend(backend)
        self._name = check_name(name)
        self._timing = Timing._build(ttl, renew_interval, margin, release_timeout)
        self._limits = HoldLimits.build(backend, max_hold, None)
        self._identity = check_identity(default_identity() if identity is None else identity)
        self._metadata = MappingProxyType(check_metadata(metadata))
        self._health: HealthPolicy | None = None
        if health is not None:
            if not callable(cast(object, health)):
                from ._exceptions import InvalidArgument

                raise InvalidArgument("health must be callable")
            interval = check_seconds(
                "health_interval",
                self._timing.renew_interval if health_interval is None else health_interval,
            )
            self._health = HealthPolicy(
                health,
                interval,
                check_count("health_failures", health_failures),
                check_seconds(
                    "health_timeout", interval if health_timeout is None else health_timeout
                ),
            )
        self._backoff = check_seconds(
            "retry_backoff",
            min(self._timing.ttl / 4, 1.0) if retry_backoff is None else retry_backoff,
        )
        self._on_elected = on_elected
        self._on_defeated = on_defeated
        self._counters = Counters()
        self._campaign_errors = 0
        self._lease: Lease | None = None
        self._unhealthy = False
        self._random = random.Random()

    def __repr__(self) -> str:
        return f"<Elector {self._name!r} identity={self._identity!r}>"

    @property
    def name(self) -> str:
        """The election name."""
        return self._name

    @property
    def identity(self) -> str:
        """This candidate's identity."""
        return self._identity

    @property
    def lease(self) -> Lease | None:
        """The current term's lease, or ``None`` when not leading."""
        lease = self._lease
        return lease if lease is not None and lease.lost is None else None

    @property
    def is_leader(self) -> bool:
        """Whether this candidate leads right now (by its local safe deadline)."""
        return self.lease is not None

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Campaign forever; run ``fn(lease, *args)`` for each term won.

        ``fn`` is cancelled when the term is lost; after a jittered back-off the
        elector campaigns again. When ``fn`` returns, the elector resigns and
        returns its value; when it raises, the elector resigns and the exception
        propagates. Stop it by cancelling it.
        """
        while True:
            result = _NOTHING
            pause = 0.0
            try:
                async with self.leadership() as lease:
                    result = await fn(lease, *args)
            except LeaseLostError as exc:
                logger.info(
                    "%s: term for %r ended: %s",
                    self._identity,
                    self._name,
                    exc.reason.value,
                    extra=log_fields(self._name, None, exc.reason),
                )
                if exc.reason is LossReason.MAX_HOLD:
                    # Every other candidate tries again within a ttl (its wait is bounded
                    # by one): let them, so that the term limit hands the role over.
                    pause = self._timing.ttl
            except BackendError as exc:
                self._campaign_errors += 1
                logger.warning(
                    "%s: campaign for %r failed: %r",
                    self._identity,
                    self._name,
                    exc,
                    extra=log_fields(self._name, None),
                )
            if result is not _NOTHING:
                return result  # type: ignore[no-any-return]
            await anyio.sleep(pause + self._backoff * self._random.uniform(0.5, 1.5))

    @asynccontextmanager
    async def leadership(self) -> AsyncIterator[Lease]:
        """Campaign until elected, then hold exactly one term.

        The block is cancelled when the term is lost, and :class:`LeaseLostError`
        is raised; on leaving normally the elector resigns.

        :raises BackendError: the backend failed while campaigning
        """
        await self._wait_healthy()
        lease = await acquire_lease(
            self._backend,
            self._name,
            self._timing,
            self._identity,
            self._metadata,
            self._counters,
            blocking=True,
        )
        if self._limits is not None:
            self._limits.apply(lease)
        logger.info(
            "%s: elected for %r with token %d",
            self._identity,
            self._name,
            lease.token,
            extra=log_fields(self._name, lease.token),
        )
        self._lease = lease
        events = lease._events
        elected = False
        try:
            async with Holding(lease, self._counters, self._health, self._defeated):
                if events.observers:
                    elected = True
                    events._emit("elected", lease)
                await _call_back(self._on_elected, lease)
                yield lease
        finally:
            self._lease = None
            if elected:
                events._emit("deposed", lease, lease.lost or LossReason.RELEASED)

    async def _defeated(self, reason: LossReason) -> None:
        if reason is LossReason.UNHEALTHY:
            self._unhealthy = True
        await _call_back(self._on_defeated, reason)

    async def _wait_healthy(self) -> None:
        policy = self._health
        while policy is not None and self._unhealthy:
            if await probe(policy.check, policy.timeout):
                self._unhealthy = False
                logger.info("%s: healthy again; campaigning for %r", self._identity, self._name)
            else:
                await anyio.sleep(policy.interval)

    async def resign(self) -> bool:
        """End the current term now (the work is cancelled; ``run`` campaigns again).

        :returns: whether a term was running
        """
        lease = self.lease
        if lease is None:
            return False
        await lease.release()
        return True

    async def leader(self) -> LeaderInfo | None:
        """Who leads now, in one read of the backend (``None``: nobody).

        A snapshot, with the term's server-side ttl left where the backend knows it
        (:attr:`LeaderInfo.remaining`); :meth:`observe` follows the changes.

        :raises BackendError: the read failed
        """
        holder = await adapt(self._backend).read(self._name)
        return None if holder is None else LeaderInfo._from_holder(holder)

    async def proclaim(self, metadata: Mapping[str, str]) -> None:
        """As the leader, publish ``metadata`` in place of the term's: etcd's Proclaim.

        No new election: the term keeps its token and its lease, and only what
        observers see changes (:meth:`leader`, :meth:`observe`, a refused candidate's
        :class:`LeaseHeldError`), as one atomic write checked against the term's owner
        and token. Observers in other processes are woken as by a change of leader
        (at once on a push backend; a polling one sees it at its next poll, within a
        ttl). Later terms of this elector publish ``metadata`` too.

        Like etcd's ``ErrElectionNotLeader``, :class:`NotOwnerError` is the answer
        whenever this candidate does not lead: it holds no term, or the backend
        reports that the term is no longer its own. In that second case the term
        also ends here, with :attr:`LossReason.STOLEN`, as a renewal hearing "not
        owner" would end it: its work is cancelled, and :meth:`leadership` raises
        :class:`LeaseLostError`.

        :raises InvalidArgument: bad ``metadata``; nothing is sent
        :raises NotOwnerError: this candidate does not lead (any more)
        :raises UnsupportedCapability: the backend does not declare
            :attr:`Capability.PROCLAIM <aiolease.abc.Capability.PROCLAIM>` (Kafka);
            nothing is sent
        :raises BackendError: the write failed; the term goes on, with the old
            metadata or the new one
        """
        checked = MappingProxyType(check_metadata(metadata))
        if Capability.PROCLAIM not in self._backend.capabilities:
            raise UnsupportedCapability(
                f"{self._backend!r} cannot change a term's metadata in place"
                " (no Capability.PROCLAIM)"
            )
        lease = self.lease
        if lease is None:
            raise NotOwnerError(self._name, f"{self!r} does not lead {self._name!r}")
        try:
            await lease.backend.update_metadata(lease.name, lease.owner, lease.token, checked)
        except NotOwnerError:
            if lease.lost is None:
                lease._end(LossReason.STOLEN)
            raise
        self._metadata = checked
        lease._metadata = checked

    async def observe(self) -> AsyncGenerator[LeaderInfo | None, None]:
        """Yield the leader now, then each change of leader or of what it proclaimed
        (``None``: no leader).

        Changes closer together than one read may be coalesced into the latest.
        """
        backend = adapt(self._backend)
        last: object = _NOTHING
        while True:
            try:
                holder = await backend.read(self._name)
            except BackendError as exc:
                logger.warning("observe %r: %r", self._name, exc)
                await anyio.sleep(self._backoff)
                continue
            key = state_of(holder)
            if key != last:
                last = key
                yield None if holder is None else LeaderInfo._from_holder(holder)
            with move_on_after(self._timing.ttl):
                try:
                    await backend.wait_changed(self._name, holder)
                except BackendError as exc:
                    logger.warning("observe %r: %r", self._name, exc)
                    await anyio.sleep(self._backoff)

    def statistics(self) -> ElectorStatistics:
        """A frozen snapshot of this elector's counters."""
        c = self._counters
        lease = self.lease
        return ElectorStatistics(
            self._name,
            self._identity,
            lease is not None,
            None if lease is None else lease.token,
            c.acquisitions,
            c.renewals,
            c.renew_failures,
            dict(c.losses),
            self._campaign_errors,
        )
