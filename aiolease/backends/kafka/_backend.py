"""KafkaBackend: leader election on consumer-group membership (see the package docstring)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, final

from aiokafka import AIOKafkaClient
from aiokafka.errors import KafkaError

from ..._exceptions import (
    BackendError,
    BackendUnavailable,
    InvalidArgument,
    LossReason,
    NotOwnerError,
)
from ...abc import Backend, Capability, Grant, HolderInfo, SessionClock
from .._asyncio import Tasks, now, timeout_after, wait_event
from ._group import record_of, view_of
from ._member import Member, Term
from ._names import check_name
from ._url import Settings, parse_url, settings_of
from ._wire import Wire

__all__ = ["KafkaBackend", "KafkaStatistics"]

logger = logging.getLogger("aiolease.backends.kafka")

#: The share of the ttl (or of the session timeout, if shorter) that ``try_acquire``
#: waits for a rebalance: a grant must leave the core a deadline after the call.
SETTLE_SHARE = 0.75
#: aiokafka's own bound on a request: above any session timeout a broker accepts.
CLIENT_TIMEOUT_MS = 1_900_000
#: Seconds a waiting observer sleeps between two reads of a group it is not in.
POLL_INTERVAL = 0.25


@final
@dataclass(frozen=True)
class KafkaStatistics:
    """A snapshot of one :class:`KafkaBackend`'s group memberships.

    :param members: memberships (one per name and candidate) alive now
    :param synced: of them, in a generation now (not rejoining)
    :param leading: of them, leading now
    """

    members: int
    synced: int
    leading: int


@final
class KafkaBackend(Backend):
    """Leader election through Kafka consumer-group membership. Election-only.

    :param client: an ``aiokafka.AIOKafkaClient`` the application made (bootstrapped
        or not); the backend never closes it
    :param options: ``group_prefix``, ``topic_prefix``, ``session_timeout``,
        ``heartbeat_interval``, ``timeout``, ``replication_factor`` (see
        :mod:`aiolease.backends.kafka`)
    :raises InvalidArgument: a bad option
    """

    requires_asyncio = True
    poll_interval = POLL_INTERVAL
    capabilities = frozenset(
        {
            Capability.SESSION,
            Capability.SERVER_TIME,
            Capability.MULTI_PROCESS,
            Capability.ELECTION_ONLY,
        }
    )

    def __init__(self, client: Any, **options: Any) -> None:
        if not isinstance(client, AIOKafkaClient):
            raise InvalidArgument(
                f"KafkaBackend needs an aiokafka.AIOKafkaClient, not {type(client).__name__}"
            )
        self._setup(
            client,
            settings_of(options),
            _settings_of(client),
            owned=False,
            described="the given client",
        )

    def _setup(
        self,
        client: Any,
        settings: Settings,
        client_options: Mapping[str, Any],
        *,
        owned: bool,
        described: str,
    ) -> None:
        self._settings = settings
        self._client_options = dict(client_options)
        self._wire = Wire(client, settings.timeout, described)
        self._owned = owned
        #: The members, by name, then by the candidate's identity and metadata.
        self._members: dict[str, dict[_Candidate, Member]] = {}
        self._floors: dict[str, int] = {}
        self._topics: set[str] = set()
        self._tasks = Tasks(logger)
        self._closed = False

    def __repr__(self) -> str:
        return f"<KafkaBackend {self._wire.described}>"

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> KafkaBackend:
        """Connect to ``kafka://host[:port][,host[:port]...][?options]``.

        :raises InvalidArgument: a malformed URL or option
        :raises BackendUnavailable: no broker answers
        """
        parsed = parse_url(url, options)
        settings = settings_of(parsed.options)
        client_options = {
            "bootstrap_servers": [f"{host}:{port}" for host, port in parsed.endpoints],
            "client_id": "aiolease",
            **parsed.client_options(),
        }
        client = _client(client_options)
        self = cls.__new__(cls)
        self._setup(client, settings, client_options, owned=True, described=parsed.described())
        try:
            await self._bootstrap()
        except BaseException:
            await client.close()
            raise
        return self

    async def _bootstrap(self) -> None:
        client = self._wire.client
        if client.cluster.brokers():
            return
        try:
            async with timeout_after(self._settings.timeout):
                await client.bootstrap()
        except (KafkaError, OSError, asyncio.TimeoutError) as exc:
            raise BackendUnavailable(
                f"no Kafka broker answers at {self._wire.described}: {exc!r}"
            ) from exc

    async def _connect(self) -> Wire:
        """A client of a member's own (see :meth:`Member.run`), bootstrapped."""
        client = _client(self._client_options)
        try:
            async with timeout_after(self._settings.timeout):
                await client.bootstrap()
        except BaseException as exc:
            await client.close()
            if isinstance(exc, (KafkaError, OSError, asyncio.TimeoutError)):
                raise BackendUnavailable(
                    f"no Kafka broker answers at {self._wire.described}: {exc!r}"
                ) from exc
            raise
        return Wire(client, self._settings.timeout, self._wire.described)

    def statistics(self) -> KafkaStatistics:
        """A frozen snapshot of the memberships."""
        live = [m for by_name in self._members.values() for m in by_name.values() if not m.closed]
        synced = [m for m in live if m.view is not None]
        leading = [m for m in synced if m.term is not None and not m.term.over]
        return KafkaStatistics(len(live), len(synced), len(leading))

    # -- members ----------------------------------------------------------------------------

    def _floor(self, name: str) -> Callable[[int | None], int]:
        """Raise and read the highest token this backend has seen for ``name``."""

        def floor(seen: int | None) -> int:
            if seen is not None and seen > self._floors.get(name, 0):
                self._floors[name] = seen
            return self._floors.get(name, 0)

        return floor

    async def _member(
        self, name: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Member:
        """The live member of ``name`` for this candidate, joined now if there was none.

        Candidates of one backend object with the same identity and metadata share one
        member (what the group shows of them is the same); others are members of their
        own, so that the group reports who leads.
        """
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        key = (identity, tuple(sorted(metadata.items())))
        member = self._members.get(name, {}).get(key)
        if member is not None and not member.closed:
            return member
        group, topic = check_name(name, self._settings.topic_prefix, self._settings.group_prefix)
        if topic not in self._topics:
            await self._bootstrap()
            await self._wire.create_topic(topic, self._settings.replication_factor)
            self._topics.add(topic)
        members = self._members.setdefault(name, {})
        member = members.get(key)  # another call may have made one meanwhile
        if member is not None and not member.closed:
            return member
        session = self._settings.session_timeout or ttl
        heartbeat = self._settings.heartbeat_for(session)
        member = Member(
            self._connect,
            name,
            group,
            topic,
            identity,
            metadata,
            session,
            heartbeat,
            self._floor(name),
            self._settings.replication_factor,
        )
        members[key] = member
        self._tasks.spawn(self._run(member, key), f"kafka member of {name!r}")
        return member

    async def _run(self, member: Member, key: _Candidate) -> None:
        try:
            await member.run()
        finally:
            members = self._members.get(member.name, {})
            if members.get(key) is member:
                del members[key]
                if not members:
                    del self._members[member.name]
            member.done.set()

    def _live(self, name: str) -> list[Member]:
        """This backend's live members of ``name``."""
        return [m for m in self._members.get(name, {}).values() if not m.closed]

    def _leading(self, name: str, owner: str, token: int | None) -> tuple[Member, Term] | None:
        """The member of ``name`` whose term ``owner`` holds (``token``, if given)."""
        for member in self._members.get(name, {}).values():
            term = member.term
            if term is not None and term.owner == owner and token in (None, term.token):
                return member, term
        return None

    def _holder(self, member: Member) -> HolderInfo | None:
        """Who leads, as ``member`` knows it (``None``: it has not synced yet).

        The owner is the acquire attempt holding the term when the leader is a member
        of this backend object, else the leader's member id. No remaining ttl: the
        leader's heartbeats keep the term, whatever ttl a call named.
        """
        view = member.view
        if view is None:
            return None
        for local in self._members.get(member.name, {}).values():
            term = local.term
            if local.member_id == view.leader and term is not None and not term.over:
                owner = term.owner if term.owner is not None else local.member_id
                return HolderInfo(
                    member.name, owner, local.identity, term.token, dict(local.metadata)
                )
        return HolderInfo(member.name, view.leader, view.identity, view.token, dict(view.metadata))

    # -- the contract -----------------------------------------------------------------------

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        """Join the group of ``name`` (once per backend object and candidate), and take
        the term if this member leads and nobody here holds it.

        A rebalance takes longer than one request (on Tansu, half the session timeout;
        on Kafka, until every member has rejoined): this waits for it at most 3/4 of
        ``ttl`` or of the session timeout (:data:`SETTLE_SHARE`: the grant must leave
        the core a useful deadline, counted from the call), and otherwise reports the
        holder as unknown (``owner`` and ``identity`` empty: a rebalance is under way);
        :meth:`wait_turn` then waits for its end.
        """
        while True:
            member = await self._member(name, ttl, identity, metadata)
            member.interest = now()
            member.waiters.add(owner)
            view = await member.settled(SETTLE_SHARE * min(ttl, member.session))
            if view is None:
                if member.closed:
                    continue  # released by another owner meanwhile: join again
                return self._rebalancing(name)
            term = member.term
            if (
                term is not None
                and not term.over
                and view.leader == member.member_id
                and term.not_before <= now()
            ):
                # The grant's deadline counts from a heartbeat sent now, not from the
                # last one, which may be most of a session old after a rebalance.
                if term.owner is None and await member.confirm():
                    if term.owner is None and not term.over:
                        term.owner = owner
                if term.owner == owner:
                    member.waiters.discard(owner)
                    return Grant(term.token, member.session, sent_at=member.confirmed)
            return self._holder(member) or self._rebalancing(name)

    def _rebalancing(self, name: str) -> HolderInfo:
        """The holder a refusal reports before its member has synced: what another
        member of this backend knows, else nobody known (owner and identity empty)."""
        known = next(filter(None, map(self._holder, self._live(name))), None)
        return known or HolderInfo(name, "", "", self._floors.get(name, 0))

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Wait until the member that ``owner`` campaigns through sees another leader,
        or the end of a rebalance."""
        for member in self._live(name):
            if owner in member.waiters:
                if _key(self._holder(member)) == _key(seen) or member.view is None:
                    await member.changed()
                return
        await self.wait_changed(name, seen)

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        """Only bookkeeping: the member's heartbeats keep the term (see :meth:`hold`).

        :raises NotOwnerError: the term of ``owner`` is over
        """
        found = self._leading(name, owner, token)
        if found is None or found[1].over:
            raise NotOwnerError(name, f"{name!r} is not led by this owner (any more)")
        member, term = found
        return Grant(term.token, member.session, sent_at=member.confirmed)

    def hold(
        self, name: str, owner: str, token: int, ended: Callable[[LossReason], object]
    ) -> SessionClock | None:
        """The member's clock: the term lasts while its heartbeats are answered."""
        found = self._leading(name, owner, token)
        if found is None or found[1].over:
            raise NotOwnerError(name, f"{name!r} is not led by this owner (any more)")
        member, term = found
        term.ended = ended
        return member

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        """Resign: leave the group at once, so that the next leader is chosen without
        waiting for a session timeout. An attempt that only waited stops waiting (the
        member stays until it is idle: leaving at once would disturb the leader)."""
        for member in self._members.get(name, {}).values():
            member.waiters.discard(owner)
            stepped = member.stepped
            if stepped is not None and stepped.owner == owner:
                stepped.released.set()  # the work of a term a rebalance ended has stopped
        found = self._leading(name, owner, token)
        if found is None:
            return False
        member, term = found
        term.released.set()
        if term.over:
            return False
        term.over = True  # the core ends the lease itself: no ended() from here
        await self._close_member(member)
        return True

    async def _close_member(self, member: Member) -> None:
        member.close()
        await wait_event(member.done, self._settings.timeout)

    async def read(self, name: str) -> HolderInfo | None:
        """The leader of ``name``: from this backend's member when it has one, else from
        the group's description and its committed offset (one request each)."""
        group, topic = check_name(name, self._settings.topic_prefix, self._settings.group_prefix)
        members = self._live(name)
        if members:
            # None in a rebalance: the leader stepped down.
            return next(filter(None, map(self._holder, members)), None)
        described = await self._wire.describe(group)
        state, members = str(described[2]), described[-1]
        if state in ("Empty", "Dead") or not members:
            return None  # (in a rebalance, the last generation's leader may be named)
        for described_member in members:
            view = view_of(bytes(described_member[-1] or b""))
            if view is not None and view.leader == described_member[0]:
                return HolderInfo(name, view.leader, view.identity, view.token, dict(view.metadata))
        # A broker that describes no assignments (Tansu): the committed token, and the
        # leader record if it is the record of that token's leader, still a member.
        token = await self._wire.committed(group, topic)
        if token < 0:
            return None
        record = record_of(await self._wire.latest(topic))
        if record is None or record.token != token:
            return HolderInfo(name, "", "", token)  # just elected: not written yet
        if record.leader not in {str(m[0]) for m in members}:
            return None  # it left: the group is about to rebalance
        return HolderInfo(name, record.leader, record.identity, token, dict(record.metadata))

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        """Wait for this backend's member to see a change; poll a group it is not in."""
        members = self._live(name)
        if not members:
            await super().wait_changed(name, seen)
            return
        current = next(filter(None, map(self._holder, members)), None)
        if _key(current) != _key(seen):
            return
        await members[0].changed()

    async def aclose(self) -> None:
        """Leave every group (bounded), stop the members, close the client if it is ours."""
        if self._closed:
            return
        self._closed = True
        members = [m for by_name in self._members.values() for m in by_name.values()]
        for member in members:
            member.close()
        try:
            async with timeout_after(self._settings.timeout):
                for member in members:
                    await member.done.wait()
        except (asyncio.TimeoutError, BackendError):
            pass
        await self._tasks.aclose()
        if self._owned:
            await self._wire.client.close()


#: The settings of an ``AIOKafkaClient`` that its members' clients copy: all of its
#: constructor's but ``request_timeout_ms`` (see :func:`_client`), ``retry_backoff_ms``
#: (kept in other units: see :func:`_settings_of`) and the deprecated no-op ``api_version``.
_CLIENT_SETTINGS = (
    "bootstrap_servers",
    "client_id",
    "metadata_max_age_ms",
    "security_protocol",
    "ssl_context",
    "connections_max_idle_ms",
    "sasl_mechanism",
    "sasl_plain_username",
    "sasl_plain_password",
    "sasl_kerberos_service_name",
    "sasl_kerberos_domain_name",
    "sasl_oauth_token_provider",
)


def _settings_of(client: Any) -> dict[str, Any]:
    """The connection settings of a client the application made (aiokafka keeps them
    in private attributes of those names), for the members' own clients."""
    settings = {
        key: getattr(client, f"_{key}") for key in _CLIENT_SETTINGS if hasattr(client, f"_{key}")
    }
    backoff = getattr(client, "_retry_backoff", None)  # seconds
    if isinstance(backoff, (int, float)):
        settings["retry_backoff_ms"] = round(backoff * 1000)
    return settings


def _client(options: Mapping[str, Any]) -> Any:
    """:raises InvalidArgument: aiokafka refuses ``options``"""
    try:
        # JoinGroup waits for the rebalance, longer than any other request: the backend
        # bounds each request itself (Wire), and aiokafka only bounds them from afar.
        return AIOKafkaClient(**options, request_timeout_ms=CLIENT_TIMEOUT_MS)
    except (TypeError, ValueError, KafkaError) as exc:
        raise InvalidArgument(f"Kafka client options refused: {exc}") from None


#: What tells the candidates of one backend apart: their identity and metadata.
_Candidate = tuple[str, tuple[tuple[str, str], ...]]


def _key(holder: HolderInfo | None) -> tuple[str, int] | None:
    return None if holder is None else (holder.owner, holder.token)
