"""The Redis backend: one Lua script per operation, push wake-ups, fair queueing, batched renewals.

URLs are redis-py's::

    redis://[[user]:password@]host[:port][/db]      rediss:// for TLS
    unix://[[user]:password@]/path/to/redis.sock[?db=0]

or for a Redis Cluster or a Sentinel-managed master (see
:mod:`aiolease.backends._redis_clients`)::

    redis+cluster://host:port[,host:port...]
    redis+sentinel://host:port[,host:port...]/service[/db]

plus ``prefix=`` (the key prefix, default ``aiolease:``), ``fair=`` (``1``/``0``),
``wait_replicas=`` and ``wait_timeout=`` in the query or as keyword arguments, and
redis-py's own query options (``socket_timeout``, ``client_name``, ``ssl_cert_reqs``,
...). A client you already
have is used as it is, and never closed by the backend::

    backend = RedisBackend(redis.asyncio.Redis(...), prefix="myapp:locks:", fair=True)

**One round trip per operation.** Acquire, renew, release and read are each one Lua
script (:mod:`aiolease.backends._redis_scripts`), called with EVALSHA and loaded on
NOSCRIPT. Expiry is Redis's own ``PEXPIRE`` (renew resets it, never adds); the
fencing token is an ``INCR`` of a per-name counter that never expires. All keys of a
name share one hash tag, so every script stays in one Cluster slot.

**Wake-ups.** Every grant and release publishes on the name's channel (but for
fair hand-offs nobody observes, below); a task in :meth:`RedisBackend.wait_changed`
is woken by it, or when the holder's remaining ttl (as the server reported it) runs
out, whichever comes first. ``wait_changed`` marks the name watched for a while.

**Fair mode** (``fair=True``): a refused acquirer joins the name's queue (its entry
expires ``ttl`` after its latest attempt: a dead waiter holds nobody up longer).
Release hands the lease straight to the queue's head and tells it on the head's
backend's own *turns* channel; the waiter behind it is told how long the grant
lasts. Nobody else is woken: the hand-off goes on the name's channel only while the
name is watched (see :mod:`aiolease.backends._redis_scripts`). The waiter hears
every message since its attempt was sent. A handed-off lease lasts what is left of
the waiter's entry. Each waiter retries at least every ``ttl / 3``, when the
holder's ttl runs out (the first attempt after a crashed holder's expiry hands the
lease on), and, next in line, when a lease handed to the waiter ahead ends.

**Batched renewals.** All leases held through one backend object are renewed in one
pipelined round trip per renew interval (:mod:`aiolease.backends._redis_batch`).

**A lean connection.** A backend made from a ``redis://`` or ``unix://`` URL sends
its own commands over one pipelined connection with hiredis's parser, not through
redis-py's client stack, which costs more CPU per command than the loopback round
trip (:mod:`aiolease.backends._redis_resp`); its pub/sub connection is a lean one
too. TLS, Cluster, Sentinel, ``wait_replicas`` and clients passed in use redis-py.

**Hand-offs without a round trip.** In fair mode the hand-off's message carries
the token and the server-side ttl of the grant, which confirms it to its waiter
(:mod:`aiolease.backends._redis_tickets`); an attempt while another task of the
backend holds the name goes in that holder's release request
(:mod:`aiolease.backends._redis_riders`). A watched channel stays subscribed a
while after its last watcher, and a watch that starts from the latest read, with no
change since, does not read again (:mod:`aiolease.backends._redis_pubsub`). A lease
granted while its channel was subscribed is watched for a takeover from the messages
the backend receives anyway: no task and no read per held lease
(:meth:`RedisBackend.on_taken`, :mod:`aiolease.backends._redis_takeover`).

**Durability.** Tokens live in Redis memory. A Redis restart without persistence
forgets the counters, and tokens start again at 1. ``DURABLE_TOKENS`` is declared
only by an instance whose single server persists every write before it answers
(``appendonly yes``, ``appendfsync always``; see :meth:`RedisBackend.detect_persistence`).
A failover to a replica that missed the latest writes can forget a counter, and a
grant: ``wait_replicas=N`` makes each grant and renewal wait (``WAIT``) until N
replicas have it, and treats a shortfall as unconfirmed.

**Cancellation.** redis-py's asyncio client may let a cancelled command complete
and return normally; the core checks for a pending cancellation after every grant
and undoes it, and the scripts make that undo (a release by owner id) safe.

Keys under the prefix that hold anything aiolease did not write raise
:class:`ForeignDataError`; they are never overwritten.

The backend is asyncio-only (``requires_asyncio``; the core bridges it under trio),
and so uses asyncio's primitives, never anyio's.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast, final
from urllib.parse import parse_qsl, urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._exceptions import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    ForeignDataError,
    InvalidArgument,
    NotOwnerError,
)
from .._urls import redact, scrub
from .._validate import check_seconds
from ..abc import Backend, Capability, Grant, HolderInfo, LossReason, RenewResult
from ..abc import Renewal as LeaseRenewal
from ._asyncio import guarded, now, wait_event, wait_for_or_none
from ._redis_batch import Renewal, RenewalBatcher
from ._redis_clients import (
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
from ._redis_pubsub import Subscriptions
from ._redis_riders import Rider, Riders, send_with, sent_with
from ._redis_scripts import (
    ACQUIRE,
    DEFAULT_PREFIX,
    FOREIGN,
    READ,
    RELEASE,
    RENEW,
    WATCH,
    Keys,
    Script,
    check_prefix,
    keys_of,
)
from ._redis_takeover import Followers
from ._redis_tickets import Marks, Tickets
from ._redis_url import OUR_OPTIONS, flag
from ._redis_url import SCHEMES as SCHEMES
from ._redis_url import parse_url as parse_url

if TYPE_CHECKING:
    from ._redis_resp import LeanClient

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

__all__ = ["ForeignDataError", "RedisBackend", "RedisStatistics"]

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
#: be left for it not to mark it again (see _redis_scripts: a release announces a
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


def _ms(seconds: float) -> int:
    # Rounded up: the server never lets a lease go before the holder's deadline.
    return max(math.ceil(seconds * 1000), 1)


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, str):
        return value
    raise TypeError(f"expected a string reply, got {value!r}")


def mapped_error(
    exc: BaseException,
    name: str | None,
    *,
    server: str = "Redis",
    client: str = "the Redis client",
    prefix: str | None = None,
) -> BackendError:
    """A driver exception as aiolease's error (the Redis and the Redlock backends').

    :param server: who failed, as messages name it (``"Redlock instance host:port"``)
    :param client: the redis-py client, as messages name it
    :param prefix: the key prefix, named in a :class:`ForeignDataError`'s message
    """
    if isinstance(exc, BackendError):
        return exc
    if isinstance(exc, ResponseError) and str(exc).startswith(FOREIGN):
        detail = str(exc)[len(FOREIGN) :].split(" script: ")[0].strip()
        named = "" if prefix is None else f" {prefix!r}"
        return ForeignDataError(
            f"{server} key {detail}. aiolease left it unchanged: another program seems to"
            f" write under the key prefix{named}; give aiolease another prefix",
            name=name or "",
        )
    if isinstance(exc, (RedisTimeoutError, TimeoutError)):
        return BackendTimeout(f"{server} did not answer in time: {exc!r}")
    if isinstance(exc, (RedisConnectionError, OSError)):
        return BackendUnavailable(f"{server} is unreachable: {exc}")
    if isinstance(exc, ResponseError):
        return BackendUnavailable(f"{server} refused the request: {exc}")
    if not isinstance(exc, RedisError):
        # redis-py failing in its own code (say, on a connection closed under it):
        # the command's fate is unknown, as when the server is unreachable.
        return BackendUnavailable(f"{client} failed: {exc!r}")
    return BackendError(f"{server} failed: {exc!r}")


def holder_from(name: str, reply: Sequence[Any], place: str | None = None) -> HolderInfo:
    """A READ or refused ACQUIRE reply ``{0, owner, identity, token, metadata, pttl}``.

    :param place: where the lease is, as the error names it (default: the lease of name)
    :raises ForeignDataError: the metadata is not a JSON map of strings
    """
    _, owner, identity, token, metadata, pttl = reply
    try:
        meta = {} if metadata == b"{}" else json.loads(_text(metadata))
        if not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
        ):
            raise ValueError("not a map of strings")
    except (ValueError, TypeError) as exc:
        raise ForeignDataError(
            f"{place or f'the lease of {name!r}'} holds metadata aiolease did not write"
            f" ({exc}); it was left unchanged",
            name=name,
        ) from exc
    return HolderInfo(name, _text(owner), _text(identity), int(token), meta, int(pttl) / 1000)


def _config_pairs(reply: object) -> dict[str, str]:
    """``CONFIG GET``'s reply (a dict from redis-py, or a flat list) as text pairs."""
    if isinstance(reply, Mapping):
        items = list(reply.items())
    elif isinstance(reply, (list, tuple)):
        items = list(zip(reply[::2], reply[1::2], strict=True))
    else:
        return {}
    return {_text(k).lower(): _text(v).lower() for k, v in items}


def _persists(config: Mapping[str, str]) -> bool:
    return config.get("appendonly") == "yes" and config.get("appendfsync") == "always"


def _identity_of(holder: HolderInfo | None) -> tuple[str, int] | None:
    return None if holder is None else (holder.owner, holder.token)


class RedisBackend(Backend):
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

    capabilities = frozenset(
        {
            Capability.PUSH_WAKEUP,
            Capability.FAIR_QUEUE,
            Capability.SERVER_TIME,
            Capability.MULTI_PROCESS,
        }
    )
    requires_asyncio = True

    def __init__(
        self,
        client: Client,
        *,
        prefix: str = DEFAULT_PREFIX,
        fair: bool = False,
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
        self._declare()
        self._owns_client = False
        self._closed = False
        #: The lean client that carries the backend's own commands, when it made the
        #: redis-py client itself and a lean connection can do what it does.
        self._lean: LeanClient | None = None
        self._subscriptions = Subscriptions(client, self._timeout)
        self._batcher = RenewalBatcher(self._send_renewals, self._timeout)
        self._tickets = Tickets()
        self._riders = Riders(refused=_refusal)
        self._followers = Followers(self._subscriptions)
        #: The channel of this backend's fair waiters' hand-offs (see _redis_scripts;
        #: empty without fair mode, or with WAIT: a hand-off is then only announced on
        #: the name's channel, and a waiter asks again when woken).
        self._turns = b""
        if self._fair and not self._replication.replicas:
            self._turns = f"{self._prefix}turns:{os.urandom(8).hex()}".encode()
            self._subscriptions.companion = self._turns
        #: Names marked watched (see _watch): since when, and until when, in loop time.
        self._watched: dict[str, tuple[float, float]] = {}

    def _declare(self) -> None:
        """Set this instance's capabilities from the class's, the mode and the server."""
        caps = type(self).capabilities - {Capability.FAIR_QUEUE, Capability.DURABLE_TOKENS}
        if self._fair:
            caps |= {Capability.FAIR_QUEUE}
        if self._durable:
            caps |= {Capability.DURABLE_TOKENS}
        self.capabilities = caps  # type: ignore[misc]

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

        :param options: ``prefix``, ``fair`` or ``timeout`` (not also in the URL)
        :raises InvalidArgument: a malformed URL or option
        :raises BackendUnavailable: the server does not answer
        """
        redis_url, ours = parse_url(url)
        for key in options:
            if key not in (*OUR_OPTIONS, "timeout") or key in ours:
                raise InvalidArgument(f"Redis option {key!r} is unknown or given twice")
        settings: dict[str, Any] = {**ours, **options}
        timeout = check_seconds("timeout", settings.pop("timeout", DEFAULT_TIMEOUT))
        defaults: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
        query = dict(parse_qsl(urlsplit(redis_url).query))
        defaults = {k: v for k, v in defaults.items() if k not in query}
        try:
            if urlsplit(redis_url).scheme.lower() in CLUSTER_SCHEMES + SENTINEL_SCHEMES:
                made = make_multi(redis_url, defaults)
            else:
                made = Made(Redis.from_url(redis_url, **defaults))
        except InvalidArgument:
            raise
        except (ValueError, TypeError) as exc:
            raise InvalidArgument(
                scrub(f"Redis URL {redact(url)!r} is not usable: {exc}", url)
            ) from None
        try:
            backend = cls(made.client, timeout=timeout, **settings)
            backend._owns_client = True
            backend._also_close = made.also_close
            if not backend._replication.replicas:  # WAIT would block the shared connection
                backend._lean = backend._subscriptions.lean = _lean_for(made.client)
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
        self._declare()
        return self._durable

    async def _config(self, pattern: str) -> dict[str, str]:
        try:
            reply = await self._call(None, "CONFIG GET", pattern)
        except BackendError as exc:
            if isinstance(exc.__cause__, ResponseError):
                return {}  # CONFIG is disabled or renamed
            raise
        return _config_pairs(reply)

    # -- talking to Redis ------------------------------------------------------------

    def _keys(self, name: str) -> Keys:
        return keys_of(self._prefix, name)

    def _mapped(self, name: str | None, exc: BaseException) -> BackendError:
        return mapped_error(exc, name, prefix=self._prefix)

    async def _call(self, name: str | None, *args: Any) -> Any:
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        try:
            if self._lean is not None:
                return await self._lean.execute(*args[0].split(), *args[1:])
            return await guarded(cast(Any, self._client).execute_command(*args))
        except Exception as exc:  # only the driver runs here: map all it raises
            raise self._mapped(name, exc) from exc

    async def _pipelined(self, commands: Sequence[Sequence[Any]], *, guard: bool) -> list[Any]:
        """Commands in one round trip; an error reply comes back as its exception.

        :param guard: raise a cancellation that redis-py let pass (see :func:`guarded`)
        """
        if self._lean is not None:
            return await self._lean.execute_many(commands)
        pipe = self._client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        sent = pipe.execute(raise_on_error=False)
        return cast(list[Any], await (guarded(sent) if guard else sent))

    async def _eval(self, name: str, script: Script, keys: Sequence[bytes], *args: Any) -> Any:
        try:
            return await self._call(name, "EVALSHA", script.sha, len(keys), *keys, *args)
        except BackendError as exc:
            if not isinstance(exc.__cause__, NoScriptError):
                raise
        await self._call(name, "SCRIPT LOAD", script.source)
        return await self._call(name, "EVALSHA", script.sha, len(keys), *keys, *args)

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
                return handed[0]  # handed over, confirmed by the wake-up (see _redis_tickets)
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
            _ms(ttl),
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
        return self._holder(name, reply)

    async def _attempt(
        self, name: str, owner: str, keys: Sequence[bytes], args: Sequence[Any]
    ) -> Any:
        """The ACQUIRE script's reply; in fair mode, sent with the release of the name
        by a task that holds it through this backend, if that comes soon enough
        (see :mod:`aiolease.backends._redis_riders`)."""
        if self._lean is None or not self._fair or not self._riders.must_wait(name, owner):
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

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        sent_at = await self._batcher.renew(name, owner, token, ttl)
        return Grant(token, ttl, sent_at=sent_at)

    renews_many = True

    async def renew_many(self, renewals: Sequence[LeaseRenewal]) -> list[RenewResult]:
        """Every lease the core's scheduler finds due, in one pipelined round trip."""
        leases = [Renewal(n, o, token, ttl, 0.0, answered=0) for n, o, token, ttl in renewals]
        ttls = [lease.ttl for lease in leases]
        replies = await wait_for_or_none(self._send_renewals(leases, ttls), self._timeout)
        if replies is None:
            raise BackendTimeout(f"renewal batch took over {self._timeout:g}s")
        self._batcher.counted(len(leases))
        results: list[RenewResult] = []
        for lease, reply in zip(leases, replies, strict=True):
            if isinstance(reply, bool):
                results.append(
                    Grant(lease.token, lease.ttl) if reply else NotOwnerError(lease.name)
                )
            elif isinstance(reply, BackendError):
                results.append(reply)
            else:
                results.append(BackendError(f"renewal of {lease.name!r}: {reply!r}"))
        return results

    async def _send_renewals(
        self, leases: Sequence[Renewal], ttls: Sequence[float]
    ) -> list[bool | BaseException]:
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        waits = self._replication
        for attempt in range(2):
            commands: list[tuple[Any, ...]] = [
                ("EVALSHA", RENEW.sha, 1, self._keys(lease.name).lease, lease.owner, lease.token)
                + (_ms(ttl),)
                for lease, ttl in zip(leases, ttls, strict=True)
            ]
            if waits.replicas:
                commands.append(("WAIT", waits.replicas, waits.timeout_ms))
            try:
                replies = await self._pipelined(commands, guard=False)
            except Exception as exc:  # only the driver runs here: map all it raises
                raise self._mapped(None, exc) from exc
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
                await self._call(None, "SCRIPT LOAD", RENEW.source)
                continue
            break
        if waits.replicas:
            acked = replies.pop()
            if isinstance(acked, BaseException):
                raise self._mapped(None, acked) from acked
            if int(acked) < waits.replicas:
                raise self._unreplicated(int(acked))
        return [
            self._mapped(lease.name, r) if isinstance(r, BaseException) else int(r) == 1
            for lease, r in zip(leases, replies, strict=True)
        ]

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        self._forget(name, owner)
        keys, args, riders, first = self._releasing(name, owner, token)
        if self._lean is None:
            return self._freed(name, await self._eval(name, RELEASE, keys, *args))
        if self._closed:
            Riders.go_alone(riders)
            raise BackendUnavailable(f"{self!r} is closed")
        request = self._send_release(name, keys, args, riders, first)
        return await self._released(name, request, keys, args)

    def release_now(self, name: str, owner: str, token: int) -> Awaitable[bool] | None:
        """:meth:`release`, its request written before returning (over a lean
        connection that is open); ``None`` in a subclass that has a release of its own."""
        if self._lean is None or self._closed or type(self).release is not RedisBackend.release:
            return None
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
        """The RELEASE request and its riders over the lean connection, written before
        returning if it is open (else when awaited, once connected); the kept refusals
        go to their attempts, which run once this task waits for the reply."""
        assert self._lean is not None
        command = ("EVALSHA", RELEASE.sha, len(keys), *keys, *args)
        settle = self._settler(name)
        request = sent_with(self._lean, command, riders, settle, announce_first=first)
        if request is None:
            request = send_with(self._lean, command, riders, settle, announce_first=first)
        self._riders.flush()
        return request

    def _settler(self, name: str) -> Callable[[Sequence[Rider], Sequence[Any], Any], None]:
        """What gives the riders of a release of ``name`` their replies: a refusal is
        kept until the next release if this one handed the lease to a waiter here
        (see :mod:`aiolease.backends._redis_riders`)."""

        def settle(riders: Sequence[Rider], replies: Sequence[Any], reply: Any) -> None:
            if isinstance(reply, list):  # {2, owner}: handed to the queue's head
                head = _text(reply[1])  # here if it waits here, or took it already
                here = self._tickets.waits(name, head) or self._riders.holds(name, head)
            else:
                here = False
            self._riders.settle(riders, replies, keep=here)

        return settle

    def _forget(self, name: str, owner: str) -> None:
        """``owner`` holds ``name`` no more (it is releasing it)."""
        self._batcher.forget(name, owner)
        self._tickets.forget(name, owner)
        self._followers.forget(name, owner)

    def _releasing(
        self, name: str, owner: str, token: int | None
    ) -> tuple[tuple[bytes, ...], tuple[Any, ...], list[Rider], bool]:
        """The keys and arguments of ``owner``'s RELEASE of ``name``, the attempts that
        ride with it (see :mod:`aiolease.backends._redis_riders`), and whether to
        announce the hand-off first (to other processes only: a waiter here runs after
        the release anyway, and better once the releaser's next attempt has been made)."""
        keys = self._keys(name)
        args = (owner, "" if token is None else token, keys.channel)
        riders = self._riders.released(name, owner)
        return keys.all, args, riders, not self._tickets.has_turns(name)

    async def _released(
        self, name: str, request: Awaitable[Any], keys: Sequence[bytes], args: Sequence[Any]
    ) -> bool:
        """What the RELEASE ``request`` (over the lean client) freed."""
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
            if self._tickets.waits(name, _text(reply[1])):  # the holder here from now on
                self._riders.granted(name, _text(reply[1]))
            return True
        return int(reply) >= 1

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
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        channel = self._keys(name).channel
        try:
            async with self._subscriptions.watch(channel) as changed:
                marked = await self._watch(name)
                # Nothing to read again if ``seen`` is our latest read, sent while the
                # name was marked watched, and no change came since (see _redis_pubsub).
                sent_at = self._subscriptions.unchanged_since(channel, seen)
                if sent_at is not None and sent_at < marked:
                    sent_at = None
                current = seen
                if sent_at is None:
                    sent_at = now()
                    current = await self.read(name)
                    if _identity_of(current) != _identity_of(seen):
                        return
                timeout = None
                if current is not None and current.remaining is not None:
                    elapsed = now() - sent_at
                    timeout = max(current.remaining + EXPIRY_SLACK - elapsed, 0.0)
                await wait_event(changed, timeout)
        except (RedisError, OSError) as exc:
            raise self._mapped(name, exc) from exc
        except TimeoutError as exc:
            raise BackendTimeout(f"Redis did not confirm a subscription for {name!r}") from exc

    async def _watch(self, name: str) -> float:
        """Mark ``name`` watched, unless it is known to stay marked for a while yet: the
        loop time from which it has been marked throughout (a read sent since then
        was answered after the mark was set)."""
        at = now()
        since, until = self._watched.get(name, (at, 0.0))
        if until - at > WATCH_AGAIN:
            return since
        await self._eval(name, WATCH, (self._keys(name).watched,), _ms(WATCH_FOR))
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
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        channel = self._keys(name).channel
        try:
            async with self._subscriptions.watch(channel) as changed:
                await changed.wait()
        except (RedisError, OSError) as exc:
            raise self._mapped(name, exc) from exc
        except TimeoutError as exc:
            raise BackendTimeout(f"Redis did not confirm a subscription for {name!r}") from exc

    def on_taken(
        self, name: str, owner: str, token: int, taken: Callable[[LossReason], object]
    ) -> Callable[[], None] | None:
        """Report a takeover from the name's pub/sub messages: no task and no read per
        lease (see :mod:`aiolease.backends._redis_takeover`); ``None`` (the core's watch
        task) unless the channel was subscribed since before the grant's attempt."""
        if self._closed:
            return None
        return self._followers.follow(name, owner, self._keys(name).channel, taken)

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """In fair mode, wait for the hand-off to this waiter announced on the name's
        channel, the holder's expiry, or the time to refresh the queue entry (see
        :mod:`aiolease.backends._redis_tickets`); otherwise :meth:`wait_changed`."""
        if not self._turns:  # announced on the name's channel: ask again when woken
            await self.wait_changed(name, seen)
            return
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        timeout = ttl * REFRESH_FRACTION
        if seen.remaining is not None:
            timeout = min(timeout, seen.remaining + EXPIRY_SLACK)
        channel = self._keys(name).channel
        subs = self._subscriptions
        turns = self._turns
        if await self._tickets.wait_turn(subs, name, owner, channel, turns, seen.token, timeout):
            return
        # Not subscribed throughout since the attempt: a hand-off may have come
        # unheard. Subscribe, and let the core try again (it then picks it up).
        try:
            async with subs.watch(channel), subs.watch(turns):
                return
        except (RedisError, OSError) as exc:
            raise self._mapped(name, exc) from exc
        except TimeoutError as exc:
            raise BackendTimeout(f"Redis did not confirm a subscription for {name!r}") from exc

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
        if self._lean is not None:
            await self._lean.aclose()
        await self._subscriptions.aclose()
        if self._owns_client:
            await _close_all(self._client, self._also_close)


def _refusal(reply: Any) -> bool:
    """Whether ``reply`` is the ACQUIRE script's refusal (``{0, owner, ...}``)."""
    return isinstance(reply, list) and reply[0] == 0


def _lean_for(client: Client) -> LeanClient | None:
    """A lean client to the server ``client`` talks to, if one can stand in for it (and
    hiredis, which ``aiolease[redis]`` installs, is there)."""
    if not single_server(client) or isinstance(client, RedisCluster):
        return None
    if importlib.util.find_spec("hiredis") is None:  # pragma: no cover
        return None
    from ._redis_resp import Endpoint, LeanClient

    pool = client.connection_pool
    endpoint = Endpoint.of(pool.connection_class.__name__, pool.connection_kwargs)
    return None if endpoint is None else LeanClient(endpoint)


async def _close_all(client: Client, also: Sequence[Callable[[], Awaitable[None]]]) -> None:
    try:
        await client.aclose()
    finally:
        for close in also:
            await close()
