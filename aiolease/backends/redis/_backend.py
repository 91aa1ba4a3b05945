"""The :class:`RedisBackend`: the contract over one Lua script per operation (see the
package docstring, :mod:`aiolease.backends.redis`).

It talks through a transport (:mod:`aiolease.backends.redis._transport`), listens
through :mod:`aiolease.backends.redis._pubsub`, and leaves renewal batching, fair
hand-offs, riders and takeover watches to their modules.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, final
from urllib.parse import parse_qsl, urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError, ResponseError

from ..._exceptions import (
    BackendError,
    BackendUnavailable,
    InvalidArgument,
    NotOwnerError,
)
from ..._records import state_of
from ..._urls import redact, scrub
from ..._validate import check_seconds
from ...abc import (
    Capability,
    Grant,
    HolderInfo,
    LossReason,
    is_permit_owner,
)
from .._asyncio import now, wait_event
from .._takers import no_watch
from ._batch import RenewalBatcher
from ._clients import (
    CLUSTER_SCHEMES,
    SENTINEL_SCHEMES,
    Client,
    Made,
    Replication,
    connection_kwargs,
    make_multi,
    single_server,
    where,
)
from ._errors import mapped_error
from ._keys import DEFAULT_PREFIX, Keys, check_prefix, keys_of
from ._permit_ops import Attempt, PermitOps, Ticket
from ._pubsub import Subscriptions, Wire
from ._renewal_ops import RenewalOps
from ._replies import config_pairs, holder_from, text
from ._riders import Rider, Riders, send_with, sent_with
from ._scripts import (
    ACQUIRE,
    READ,
    RELEASE,
    UPDATE_METADATA,
    WATCH,
    Script,
    ms,
)
from ._takeover import Followers
from ._tickets import Marks, Tickets
from ._transport import RedisPyTransport, Transport, choose
from ._url import OUR_OPTIONS, flag, parse_url

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

__all__ = ["RedisBackend", "RedisStatistics"]

#: Seconds a command may take on a client the backend makes itself.
DEFAULT_TIMEOUT = 5.0
#: Seconds a ``WAIT`` for replicas may block, when ``wait_replicas`` is set.
DEFAULT_WAIT_TIMEOUT = 0.5
#: Added to a PTTL before waking for the holder's expiry: PTTL is rounded down to whole
#: milliseconds, and Redis expires a key only once its millisecond clock has passed it.
EXPIRY_SLACK = 0.002
#: A fair waiter retries (and so refreshes its queue entry) at least this often, per ttl.
REFRESH_FRACTION = 1 / 3
#: Seconds a ``wait_changed`` marks its name watched for, and how much of that must
#: be left for it not to mark it again (see _scripts: a release announces a
#: hand-off on the name's channel only while its name is watched).
WATCH_FOR = 60.0
WATCH_AGAIN = 30.0
#: Names whose watch marks a backend remembers before it drops the lapsed ones.
MAX_WATCHED = 1024


@final
@dataclass(frozen=True)
class RedisStatistics:
    """A snapshot of one :class:`RedisBackend`'s renewal batching.

    :param renewing: leases whose keepalive currently renews through this backend
    :param batches: renewal round trips sent
    :param renewals: lease renewals carried by them
    """

    renewing: int
    batches: int
    renewals: int


def _persists(config: Mapping[str, str]) -> bool:
    return config.get("appendonly") == "yes" and config.get("appendfsync") == "always"


#: What every instance guarantees, whatever its mode and server.
CAPABILITIES = frozenset(
    {
        Capability.PUSH_WAKEUP,
        Capability.SERVER_TIME,
        Capability.MULTI_PROCESS,
        Capability.PROCLAIM,
        Capability.SEMAPHORE,
        Capability.FAIR_PERMITS,
        Capability.PERMIT_RETRY_KEEPS_ENTRY,
    }
)


class RedisBackend(RenewalOps, PermitOps):
    """Leases on one Redis server, a Cluster, or a Sentinel's master (see the module docstring).

    :param client: a ``redis.asyncio.Redis`` client (also one from
        ``Sentinel.master_for``) or a ``RedisCluster``; the backend never closes it
    :param prefix: prepended to every key (1-128 printable bytes, no braces or spaces)
    :param fair: serve waiters first come, first served (adds ``FAIR_QUEUE``)
    :param timeout: seconds to wait for a subscription or a renewal batch
    :param wait_replicas: after each grant and renewal, ``WAIT`` for this many replicas;
        fewer in time means not confirmed (not with a Cluster)
    :param wait_timeout: seconds that ``WAIT`` may block
    :raises InvalidArgument: a bad client, prefix, flag or timeout
    """

    requires_asyncio = True

    def __init__(
        self,
        client: Client,
        *,
        prefix: str = DEFAULT_PREFIX,
        fair: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        wait_replicas: int | str = 0,
        wait_timeout: float | str = DEFAULT_WAIT_TIMEOUT,
    ) -> None:
        if not isinstance(client, (Redis, RedisCluster)):
            raise InvalidArgument(
                f"client must be a redis.asyncio.Redis or RedisCluster, not {type(client).__name__}"
            )
        self._client = client
        self._prefix = check_prefix(prefix)
        self._fair = flag("fair", fair)
        self._timeout = check_seconds("timeout", timeout)
        self._replication = Replication.of(client, wait_replicas, wait_timeout)
        self._also_close: list[Callable[[], Awaitable[None]]] = []
        self._durable = False
        self._owns_client = False
        self._closed = False
        #: What carries the backend's own commands (from_url may choose a lean one).
        self._wire: Transport = RedisPyTransport(client)
        self._subscriptions = Subscriptions(self._subscriber, self._timeout)
        self._batcher = RenewalBatcher(self._send_renewals, self._timeout)
        #: The lease keys of the names renewed through this backend (see _lease_key).
        self._lease_keys: dict[str, bytes] = {}
        self._tickets = Tickets()
        self._riders = Riders(refused=_refusal)
        self._followers = Followers(self._subscriptions)
        #: The channel of this backend's fair waiters' hand-offs (see _scripts;
        #: empty without fair mode, or with WAIT: a hand-off is then only announced on
        #: the name's channel, and a waiter asks again when woken).
        self._turns = b""
        if self._fair and not self._replication.replicas:
            self._turns = f"{self._prefix}turns:{os.urandom(8).hex()}".encode()
            self._subscriptions.companion = self._turns
        #: Names marked watched (see _watch): since when, and until when, in loop time.
        self._watched: dict[str, tuple[float, float]] = {}
        #: Names an attempt through this backend found held (the newest last): only
        #: their releases announce a hand-off with a leading PING (see _releasing).
        self._contended: dict[str, None] = {}
        #: Refused permit requests: where their name's permit channel stood before the
        #: attempt (``None``: not subscribed then), for wait_permit_turn.
        self._permit_marks: dict[tuple[str, str], Attempt] = {}
        self._permit_tickets: dict[tuple[str, str], Ticket] = {}

    async def _subscriber(self) -> Wire:
        """A pub/sub connection of the backend's transport."""
        return await self._wire.subscriber()

    @property
    def capabilities(self) -> frozenset[Capability]:
        """:data:`CAPABILITIES`, with :attr:`Capability.FAIR_QUEUE` in fair mode and
        :attr:`Capability.DURABLE_TOKENS` on a server that persists every write
        (:meth:`detect_persistence`)."""
        fair = {Capability.FAIR_QUEUE} if self._fair else set()
        durable = {Capability.DURABLE_TOKENS} if self._durable else set()
        return CAPABILITIES | fair | durable

    def __repr__(self) -> str:
        db = connection_kwargs(self._client).get("db", 0)
        fair = " fair" if self._fair else ""
        return f"<RedisBackend {where(self._client)} db={db} prefix={self._prefix!r}{fair}>"

    @property
    def client(self) -> Client:
        """The redis-py client the backend talks through."""
        return self._client

    @property
    def prefix(self) -> str:
        """The key prefix."""
        return self._prefix

    @property
    def fair(self) -> bool:
        """Whether waiters are served first come, first served."""
        return self._fair

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> Self:
        """Connect to ``redis://``, ``rediss://`` or ``unix://`` (see the module docstring).

        :param options: ``prefix``, ``fair``, ``wait_replicas``, ``wait_timeout``,
            ``transport`` or ``timeout`` (not also in the URL). ``transport`` is how the
            backend's own commands travel: ``auto`` (the default) over a lean connection
            where one can serve the URL, else through redis-py; ``lean`` (or
            :class:`InvalidArgument`); ``redis-py``
            (see :mod:`aiolease.backends.redis._transport`)
        :raises InvalidArgument: a malformed URL or option
        :raises BackendUnavailable: the server does not answer
        """
        redis_url, ours = parse_url(url)
        for key in options:
            if key not in (*OUR_OPTIONS, "timeout") or key in ours:
                raise InvalidArgument(f"Redis option {key!r} is unknown or given twice")
        settings: dict[str, Any] = {**ours, **options}
        timeout = check_seconds("timeout", settings.pop("timeout", DEFAULT_TIMEOUT))
        transport = settings.pop("transport", "auto")
        made = _make_client(url, redis_url, timeout)
        try:
            backend = cls(made.client, timeout=timeout, **settings)
            backend._owns_client = True
            backend._also_close = made.also_close
            replicas = backend._replication.replicas
            backend._wire = choose(transport, made.client, redis_url, timeout, replicas=replicas)
            await backend.ping()
            await backend.detect_persistence()
        except BaseException:
            await asyncio.shield(_close_all(made.client, made.also_close))
            raise
        return backend

    async def ping(self) -> None:
        """One round trip to the server.

        :raises BackendUnavailable: it does not answer
        """
        await self._call(None, "PING")

    async def detect_persistence(self) -> bool:
        """Ask the server whether it writes every change to disk before it answers
        (``appendonly yes`` with ``appendfsync always``), and declare
        ``DURABLE_TOKENS`` if so (:meth:`from_url` asks when it connects).

        Then a restart of the server keeps the token counters, and the leases with
        their expiry: nobody is granted a lease the server confirmed before it died.
        A server that refuses ``CONFIG`` (managed services often do) counts as not
        persistent, and so do a Cluster and a Sentinel-managed master.

        :raises BackendUnavailable: the server does not answer
        """
        # A Cluster answers for one node, and a Sentinel failover can lose writes
        # whatever the master's persistence: neither is asked.
        self._durable = single_server(self._client) and _persists(await self._config("append*"))
        return self._durable

    async def _config(self, pattern: str) -> dict[str, str]:
        try:
            reply = await self._call(None, "CONFIG GET", pattern)
        except BackendError as exc:
            if isinstance(exc.__cause__, ResponseError):
                return {}  # CONFIG is disabled or renamed
            raise
        return config_pairs(reply)

    # -- talking to Redis ------------------------------------------------------------

    def _keys(self, name: str) -> Keys:
        return keys_of(self._prefix, name)

    def _mapped(self, name: str | None, exc: BaseException) -> BackendError:
        return mapped_error(exc, name, prefix=self._prefix)

    @asynccontextmanager
    async def _watching(
        self, name: str, channel: bytes | None = None
    ) -> AsyncIterator[asyncio.Event]:
        """Subscribed to ``name``'s channel for the block: an event set by the next grant
        or release announced on it.

        :raises BackendUnavailable: the backend is closed
        :raises BackendError: what subscribing raises in the block, mapped: redis-py's
            errors, the socket's, and the :class:`TimeoutError` (an :class:`OSError`)
            of a subscription the server did not confirm in time
        """
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        try:
            channel = self._keys(name).channel if channel is None else channel
            async with self._subscriptions.watch(channel) as changed:
                yield changed
        except (RedisError, OSError) as exc:
            raise self._mapped(name, exc) from exc

    async def _call(self, name: str | None, *args: Any) -> Any:
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        try:
            return await self._wire.call(*args)
        except Exception as exc:  # only the driver runs here: map all it raises
            raise self._mapped(name, exc) from exc

    async def _pipelined(self, commands: Sequence[Sequence[Any]], *, guard: bool) -> list[Any]:
        """Commands in one round trip; an error reply comes back as its exception.

        :param guard: raise a cancellation that redis-py let pass
            (see :func:`aiolease.backends._asyncio.guarded`)
        """
        return await self._wire.batch(commands, guard=guard)

    async def _eval(self, name: str, script: Script, keys: Sequence[bytes], *args: Any) -> Any:
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        try:
            return await self._wire.eval(script, keys, *args)
        except Exception as exc:  # only the driver runs here: map all it raises
            raise self._mapped(name, exc) from exc

    def _holder(self, name: str, reply: Sequence[Any]) -> HolderInfo:
        return holder_from(name, reply, f"Redis key {self._keys(name).lease!r}")

    # -- the contract ----------------------------------------------------------------

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        keys = self._keys(name)
        if self._turns:  # fair, and a ticket was never WAITed for
            handed = self._tickets.take(name, owner)
            if handed is not None and handed[0].ttl <= ttl:
                # heard on the turns channel: the name's later messages are newer
                self._followers.granted(name, owner, handed[1], after=True)
                self._riders.granted(name, owner)
                return handed[0]  # handed over, confirmed by the wake-up (see _tickets)
        # Where the channel stands before the attempt (for on_taken): a grant's message
        # comes after it. (Fair with WAIT: no ticket, no mark.)
        since = mark = self._subscriptions.mark(keys.channel)
        if self._turns:
            turns = self._subscriptions.mark(self._turns)
            self._tickets.attempt(name, owner, Marks(mark, turns))
        elif self._fair:
            since = None
        meta = json.dumps(dict(metadata), ensure_ascii=False, sort_keys=True) if metadata else "{}"
        fair = "1" if self._fair else "0"
        args = (
            owner,
            ms(ttl),
            identity.encode(),
            meta.encode(),
            fair,
            keys.channel,
            self._turns,
        )
        if not self._replication.replicas:
            reply = await self._attempt(name, owner, keys.all, args)
        else:
            reply, acked = await self._eval_waited(name, ACQUIRE, keys.all, *args)
            if int(reply[0]) == 1 and acked < self._replication.replicas:
                await self.release(name, owner, int(reply[1]))
                raise self._unreplicated(acked)
        if int(reply[0]) == 1:
            self._tickets.forget(name, owner)
            self._followers.granted(name, owner, since)
            if self._fair:
                self._riders.granted(name, owner)
            return Grant(int(reply[1]), ttl)
        self._contend(name)
        return self._holder(name, reply)

    def _contend(self, name: str) -> None:
        """Remember that ``name`` has waiters (bounded: the oldest half is dropped)."""
        contended = self._contended
        contended.pop(name, None)
        contended[name] = None
        if len(contended) > MAX_WATCHED:
            for old in list(contended)[: MAX_WATCHED // 2]:
                del contended[old]

    async def _attempt(
        self, name: str, owner: str, keys: Sequence[bytes], args: Sequence[Any]
    ) -> Any:
        """The ACQUIRE script's reply; in fair mode, sent with the release of the name
        by a task that holds it through this backend, if that comes soon enough
        (see :mod:`aiolease.backends.redis._riders`)."""
        if not self._fair or not self._riders.must_wait(name, owner):
            return await self._eval(name, ACQUIRE, keys, *args)
        reply = await self._riders.ride(name, args, lambda: self._eval(name, ACQUIRE, keys, *args))
        if isinstance(reply, NoScriptError):
            return await self._eval(name, ACQUIRE, keys, *args)
        if isinstance(reply, BaseException):
            raise self._mapped(name, reply) from reply
        return reply

    def _unreplicated(self, acked: int) -> BackendUnavailable:
        r = self._replication
        return BackendUnavailable(
            f"the write reached {acked} of the {r.replicas} replicas asked for within"
            f" {r.timeout_ms} ms (wait_replicas); it is not confirmed"
        )

    async def _eval_waited(
        self, name: str, script: Script, keys: Sequence[bytes], *args: Any
    ) -> tuple[Any, int]:
        """EVALSHA, then ``WAIT`` on the same connection (a pipeline): the reply, and
        how many replicas acknowledged the write."""
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        r = self._replication
        for attempt in range(2):
            commands = [("EVALSHA", script.sha, len(keys), *keys, *args)]
            commands.append(("WAIT", r.replicas, r.timeout_ms))
            try:
                replies = await self._pipelined(commands, guard=True)
            except Exception as exc:  # only the driver runs here: map all it raises
                raise self._mapped(name, exc) from exc
            if attempt == 0 and isinstance(replies[0], NoScriptError):
                await self._call(name, "SCRIPT LOAD", script.source)
                continue
            break
        for reply in replies:
            if isinstance(reply, BaseException):
                raise self._mapped(name, reply) from reply
        return replies[0], int(replies[1])

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        if is_permit_owner(owner):
            return await self._release_permit(name, owner, token)
        self._forget(name, owner)
        keys, args, riders, first = self._releasing(name, owner, token)
        if self._closed:
            Riders.go_alone(riders)
            raise BackendUnavailable(f"{self!r} is closed")
        request = self._send_release(name, keys, args, riders, first)
        return await self._released(name, request, keys, args)

    def release_now(self, name: str, owner: str, token: int) -> Awaitable[bool] | None:
        """:meth:`release`, its request written before returning (where the transport
        can write at once); ``None`` in a subclass that has a release of its own."""
        own = type(self).release is RedisBackend.release
        if not self._wire.writes_now or self._closed or not own:
            return None
        if is_permit_owner(owner):
            return self._permit_release_now(name, owner, token)
        keys, args, riders, first = self._releasing(name, owner, token)
        request = self._send_release(name, keys, args, riders, first)
        self._forget(name, owner)  # after the write: nothing is read before the await
        return self._released(name, request, keys, args)

    def _send_release(
        self,
        name: str,
        keys: Sequence[bytes],
        args: Sequence[Any],
        riders: Sequence[Rider],
        first: bool,
    ) -> Awaitable[Any]:
        """The RELEASE request and its riders, written before returning if the transport
        can (else when awaited); the kept refusals go to their attempts, which run once
        this task waits for the reply."""
        command = ("EVALSHA", RELEASE.sha, len(keys), *keys, *args)
        settle = self._settler(name)
        request = sent_with(self._wire, command, riders, settle, announce_first=first)
        if request is None:
            request = send_with(self._wire, command, riders, settle, announce_first=first)
        self._riders.flush()
        return request

    def _settler(self, name: str) -> Callable[[Sequence[Rider], Sequence[Any], Any], None]:
        """What gives the riders of a release of ``name`` their replies: a refusal is
        kept until the next release if this one handed the lease to a waiter here
        (see :mod:`aiolease.backends.redis._riders`)."""

        def settle(riders: Sequence[Rider], replies: Sequence[Any], reply: Any) -> None:
            if isinstance(reply, list):  # {2, owner}: handed to the queue's head
                head = text(reply[1])  # here if it waits here, or took it already
                here = self._tickets.waits(name, head) or self._riders.holds(name, head)
            else:
                here = False
            self._riders.settle(riders, replies, keep=here)

        return settle

    def _forget(self, name: str, owner: str) -> None:
        """``owner`` holds ``name`` no more (it is releasing it)."""
        self._lease_keys.pop(name, None)
        self._batcher.forget(name, owner)
        self._tickets.forget(name, owner)
        self._followers.forget(name, owner)

    def _releasing(
        self, name: str, owner: str, token: int | None
    ) -> tuple[tuple[bytes, ...], tuple[Any, ...], list[Rider], bool]:
        """The keys and arguments of ``owner``'s RELEASE of ``name``, the attempts that
        ride with it (see :mod:`aiolease.backends.redis._riders`), and whether to
        announce the hand-off first (to other processes only: a waiter here runs after
        the release anyway, and better once the releaser's next attempt has been made;
        and only for a name found held by an attempt through this backend: a release
        that nobody waits for sends nothing but itself)."""
        keys = self._keys(name)
        args = (owner, "" if token is None else token, keys.channel)
        riders = self._riders.released(name, owner)
        first = (
            self._wire.announces and name in self._contended and not self._tickets.has_turns(name)
        )
        return keys.all, args, riders, first

    async def _released(
        self, name: str, request: Awaitable[Any], keys: Sequence[bytes], args: Sequence[Any]
    ) -> bool:
        """What the RELEASE ``request`` freed."""
        try:
            reply = await request
        except Exception as exc:  # only the driver runs here: map all it raises
            raise self._mapped(name, exc) from exc
        if isinstance(reply, NoScriptError):
            reply = await self._eval(name, RELEASE, keys, *args)
        elif isinstance(reply, BaseException):
            raise self._mapped(name, reply) from reply
        return self._freed(name, reply)

    def _freed(self, name: str, reply: Any) -> bool:
        if isinstance(reply, list):  # {2, owner}: handed to the queue's head
            if self._tickets.waits(name, text(reply[1])):  # the holder here from now on
                self._riders.granted(name, text(reply[1]))
            return True
        return int(reply) >= 1

    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        """Replace the holder's metadata (one script; published on the name's channel as
        a grant to the holder, which wakes watchers and takes nobody)."""
        keys = self._keys(name)
        meta = json.dumps(dict(metadata), ensure_ascii=False, sort_keys=True) if metadata else "{}"
        args = (owner, token, meta.encode(), keys.channel)
        if not self._replication.replicas:
            reply = await self._eval(name, UPDATE_METADATA, (keys.lease,), *args)
        else:
            reply, acked = await self._eval_waited(name, UPDATE_METADATA, (keys.lease,), *args)
            if int(reply) == 1 and acked < self._replication.replicas:
                raise self._unreplicated(acked)  # written, or not: unconfirmed either way
        if int(reply) != 1:
            raise NotOwnerError(name)

    async def read(self, name: str) -> HolderInfo | None:
        keys = self._keys(name)
        stamp = self._subscriptions.stamp(keys.channel)
        sent_at = now()
        reply = await self._eval(name, READ, (keys.lease,))
        holder = None if reply is None else self._holder(name, reply)
        self._subscriptions.noted(keys.channel, holder, sent_at, stamp)
        return holder

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        """Return when ``name``'s holder differs from ``seen``: on the next grant or
        release anywhere, or when the current holder's server-side ttl runs out.

        :raises BackendError: Redis failed, or did not confirm the subscription in time
        """
        async with self._watching(name) as changed:
            marked = await self._watch(name)
            # Nothing to read again if ``seen`` is our latest read, sent while the
            # name was marked watched, and no change came since (see _pubsub).
            channel = self._keys(name).channel
            sent_at = self._subscriptions.unchanged_since(channel, seen)
            if sent_at is not None and sent_at < marked:
                sent_at = None
            current = seen
            if sent_at is None:
                sent_at = now()
                current = await self.read(name)
                if state_of(current) != state_of(seen):
                    return
            timeout = None
            if current is not None and current.remaining is not None:
                elapsed = now() - sent_at
                timeout = max(current.remaining + EXPIRY_SLACK - elapsed, 0.0)
            await wait_event(changed, timeout)

    async def _watch(self, name: str) -> float:
        """Mark ``name`` watched, unless it is known to stay marked for a while yet: the
        loop time from which it has been marked throughout (a read sent since then
        was answered after the mark was set)."""
        at = now()
        since, until = self._watched.get(name, (at, 0.0))
        if until - at > WATCH_AGAIN:
            return since
        await self._eval(name, WATCH, (self._keys(name).watched,), ms(WATCH_FOR))
        if until <= now():  # lapsed, or never marked: marked from now on
            since = now()
        if len(self._watched) >= MAX_WATCHED:
            self._watched = {n: w for n, w in self._watched.items() if w[1] > at}
        self._watched[name] = (since, at + WATCH_FOR)  # counted from the send: safe
        return since

    async def wait_taken(self, name: str, held: HolderInfo) -> None:
        """Return on the next grant or release of ``name`` announced anywhere: no read and
        no timer (a renewal does not announce, and the holder's renewals see what a missed
        announcement would hide).

        :raises BackendError: Redis failed, or did not confirm the subscription in time
        """
        async with self._watching(name) as changed:
            await changed.wait()

    def on_taken(
        self, name: str, owner: str, token: int, taken: Callable[[LossReason], object]
    ) -> Callable[[], None] | None:
        """Report a takeover from the name's pub/sub messages: no task, no subscription
        and no read per lease (see :mod:`aiolease.backends.redis._takeover`). Unless the
        channel was subscribed since before the grant's attempt (a waiter or observer
        here watches the name), nothing is heard, and the holder's next renewal reports
        a takeover (``STOLEN``): a grant is published only while the name is watched,
        so a watch task per lease would hear nothing either."""
        if self._closed:
            return None
        if is_permit_owner(owner):
            return no_watch  # nobody takes a permit over: its renewals see it gone
        stop = self._followers.follow(name, owner, self._keys(name).channel, taken)
        return no_watch if stop is None else stop

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """In fair mode, wait for the hand-off to this waiter announced on the name's
        channel, the holder's expiry, or the time to refresh the queue entry (see
        :mod:`aiolease.backends.redis._tickets`); otherwise :meth:`wait_changed`."""
        if not self._turns:  # announced on the name's channel: ask again when woken
            await self.wait_changed(name, seen)
            return
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        timeout = self._turn_timeout(ttl, seen)
        channel = self._keys(name).channel
        subs = self._subscriptions
        turns = self._turns
        if await self._tickets.wait_turn(subs, name, owner, channel, turns, seen.token, timeout):
            return
        # Not subscribed throughout since the attempt: a hand-off may have come
        # unheard. Subscribe, and let the core try again (it then picks it up).
        async with self._watching(name), subs.watch(turns):
            return

    def _turn_timeout(self, ttl: float, seen: HolderInfo) -> float:
        """How long a refused waiter may wait before it tries again: until ``seen``
        (what blocked it) expires, and at most a third of its ttl, so that the retry
        refreshes its queue entry in time."""
        timeout = ttl * REFRESH_FRACTION
        if seen.remaining is not None:
            timeout = min(timeout, seen.remaining + EXPIRY_SLACK)
        return timeout

    def statistics(self) -> RedisStatistics:
        """A frozen snapshot of the renewal batching."""
        b = self._batcher
        return RedisStatistics(len(b), b.batches, b.renewals)

    async def aclose(self) -> None:
        """Stop listening, and close the client if the backend made it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await asyncio.shield(self._close())

    async def _close(self) -> None:
        self._riders.flush()
        await self._wire.aclose()
        await self._subscriptions.aclose()
        if self._owns_client:
            await _close_all(self._client, self._also_close)


def _refusal(reply: Any) -> bool:
    """Whether ``reply`` is the ACQUIRE script's refusal (``{0, owner, ...}``)."""
    return isinstance(reply, list) and reply[0] == 0


def _make_client(url: str, redis_url: str, timeout: float) -> Made:
    """The redis-py client of ``redis_url`` (``url`` less aiolease's options); commands
    and connects time out after ``timeout`` seconds unless the URL says otherwise.

    :raises InvalidArgument: redis-py cannot use the URL
    """
    defaults: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    query = dict(parse_qsl(urlsplit(redis_url).query))
    defaults = {k: v for k, v in defaults.items() if k not in query}
    try:
        if urlsplit(redis_url).scheme.lower() in CLUSTER_SCHEMES + SENTINEL_SCHEMES:
            return make_multi(redis_url, defaults)
        return Made(Redis.from_url(redis_url, **defaults))
    except InvalidArgument:
        raise
    except (ValueError, TypeError) as exc:
        message = f"Redis URL {redact(url)!r} is not usable: {exc}"
        raise InvalidArgument(scrub(message, url)) from None


async def _close_all(client: Client, also: Sequence[Callable[[], Awaitable[None]]]) -> None:
    try:
        await client.aclose()
    finally:
        for close in also:
            await close()
