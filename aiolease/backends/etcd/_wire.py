"""The wire to etcd: one gRPC channel, the v3 stubs, and the mapping of gRPC errors.

The backend speaks etcd's v3 gRPC API through the stubs that aetcd generates
(``aetcd.rpc``): aetcd's own helpers cannot send a range with a sort order and a
limit inside a transaction, a put that keeps the value (``ignore_value``), or a
watch that is cancelled with its caller. A :class:`Wire` is built either on a
channel of its own (from the URL: several endpoints, TLS, user and password) or on
an ``aetcd.Client`` the application already has (its channel and auth token are
used, and it is never closed here).

Every gRPC error is mapped here, at the boundary, to the most specific
:class:`~aiolease.BackendError`.

Bursts. At most :data:`MAX_IN_FLIGHT` KV requests (``Txn``, ``DeleteRange``,
``Range``) of one wire are in flight at a time; more wait here, in arrival order
(:class:`Limiter`). Thousands of releases at once (every body of a process ending
together) would otherwise reach the server together: etcd refuses proposals while
its applied index lags the committed one by more than 5,000 entries ("etcdserver:
too many requests"), and the session's keepalive, sent on the same connection,
would wait behind all of them. Keepalives, lease grants and revocations, and watches
never wait here. A request refused with "too many requests" was refused before it
was proposed (nothing of it was applied), so every request is sent again, with
backoff, for as long as its timeout allows (:meth:`Wire.unary`).
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import random
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import grpc
from aetcd import rpc

from ..._exceptions import BackendError, BackendTimeout, BackendUnavailable, InvalidArgument
from .._asyncio import now
from ._aio import await_unary, cancellable, read_owned
from ._deletes import DeleteBatches

__all__ = [
    "MAX_IN_FLIGHT",
    "LeaseIdTaken",
    "Limiter",
    "SessionGone",
    "Wire",
    "grpc_target",
    "is_ip",
    "map_rpc_error",
    "mapped",
]

#: Makes a member refuse a watch (and cancel it later) while it has no leader.
REQUIRE_LEADER = ("hasleader", "true")
#: gRPC keepalive pings, so that a silently dead connection is noticed (etcd refuses
#: pings more often than every 5 s by default); and reconnects at most 1 s apart
#: (gRPC's default backoff grows to 2 min, so a client would stay cut off from a
#: restarted server far longer than any lease's ttl). Not
#: ``grpc.min_reconnect_backoff_ms``: gRPC also uses it as the time a connection
#: attempt may take, and 100 ms made attempts time out on a busy machine.
CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1_000,
}


#: KV requests of one wire in flight at a time (see the module docstring).
MAX_IN_FLIGHT = 256
#: First delay before a request refused with "too many requests" is sent again
#: (doubles, with jitter, up to :data:`BUSY_RETRY_MAX`).
BUSY_RETRY_MIN = 0.01
BUSY_RETRY_MAX = 0.25
#: What etcd says when it refuses a proposal because applying lags behind.
TOO_MANY_REQUESTS = "too many requests"


class Limiter:
    """At most ``limit`` holders at a time; the others wait in arrival order.

    Taking a free place does not await (:meth:`take`), so a wire that is not busy pays
    two comparisons; a place given back goes straight to the first waiter.
    """

    __slots__ = ("free", "waiters")

    def __init__(self, limit: int) -> None:
        self.free = limit
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def take(self) -> bool:
        """Take a place if one is free and nobody waits for one."""
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return True
        return False

    async def wait(self) -> None:
        """Wait for a place (:meth:`take` failed)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.give_back()  # handed a place while being cancelled: pass it on
            else:
                with suppress(ValueError):  # (unless a give_back popped it, cancelled)
                    self.waiters.remove(waiter)
            raise

    def give_back(self) -> None:
        """Give a place back: to the first waiter, else to the free ones."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.free += 1


class SessionGone(BackendError):
    """The server no longer has the session lease (it expired or was revoked)."""


class LeaseIdTaken(BackendError):
    """A lease with the chosen id exists already."""


_UNAVAILABLE = {
    "UNAVAILABLE",
    "CANCELLED",
    "UNAUTHENTICATED",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "ABORTED",
}


def is_busy(exc: Any) -> bool:
    """Whether the gRPC error ``exc`` is etcd refusing a proposal it never made."""
    name = getattr(exc.code(), "name", "")
    return name == "RESOURCE_EXHAUSTED" and TOO_MANY_REQUESTS in (exc.details() or "")


def map_rpc_error(exc: Any, what: str) -> BackendError:
    """The :class:`BackendError` for a gRPC error ``exc`` raised by ``what``."""
    code = exc.code()
    name = getattr(code, "name", str(code))
    details = exc.details() or ""
    message = f"etcd {what}: {name}: {details}"
    if name == "NOT_FOUND" and "lease not found" in details:
        return SessionGone(message)
    if name == "FAILED_PRECONDITION" and "lease already exists" in details:
        return LeaseIdTaken(message)
    if name == "DEADLINE_EXCEEDED":
        return BackendTimeout(message)
    if name in _UNAVAILABLE or "authentication failed" in details:
        return BackendUnavailable(message)
    return BackendError(message)


@contextmanager
def mapped(what: str) -> Iterator[None]:
    """Raise driver and transport errors inside the block as :class:`BackendError`."""
    try:
        yield
    except rpc.AioRpcError as exc:
        raise map_rpc_error(exc, what) from exc
    except (grpc.aio.UsageError, OSError) as exc:
        raise BackendUnavailable(f"etcd {what}: {exc!r}") from exc


def is_ip(host: str, version: int) -> bool:
    """Whether ``host`` is an IP address of ``version`` (4 or 6)."""
    try:
        return ipaddress.ip_address(host).version == version
    except ValueError:
        return False


async def _resolve(host: str, port: int) -> list[str]:
    """The IPv4 addresses of ``host``."""
    loop = asyncio.get_running_loop()
    found = await loop.getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in found})


async def grpc_target(endpoints: Sequence[tuple[str, int]]) -> str:
    """A gRPC target that fails over between ``endpoints`` (``host, port`` pairs).

    gRPC's ``ipv4:``/``ipv6:`` targets list addresses; host names are resolved here
    (IPv4) when there are several endpoints.

    :raises InvalidArgument: IPv6 mixed with anything else
    :raises BackendUnavailable: a host name does not resolve
    """
    if len(endpoints) == 1:
        host, port = endpoints[0]
        if is_ip(host, 6):
            return f"ipv6:[{host}]:{port}"
        return f"ipv4:{host}:{port}" if is_ip(host, 4) else f"dns:///{host}:{port}"
    if all(is_ip(host, 6) for host, _ in endpoints):
        return "ipv6:" + ",".join(f"[{host}]:{port}" for host, port in endpoints)
    if any(is_ip(host, 6) for host, _ in endpoints):
        raise InvalidArgument("etcd endpoints cannot mix IPv6 addresses with IPv4 or host names")
    addresses: list[str] = []
    for host, port in endpoints:
        try:
            ips = [host] if is_ip(host, 4) else await _resolve(host, port)
        except OSError as exc:
            raise BackendUnavailable(f"etcd endpoint {host!r} does not resolve: {exc}") from exc
        addresses += [f"{ip}:{port}" for ip in ips]
    return "ipv4:" + ",".join(addresses)


@dataclass(frozen=True)
class _Stubs:
    channel: Any
    kv: Any
    lease: Any
    watch: Any
    #: ``KV.Txn`` for a request serialized already (:mod:`._encoded`).
    txn_encoded: Any


def _txn(stubs: _Stubs) -> Any:
    return stubs.kv.Txn


def _txn_encoded(stubs: _Stubs) -> Any:
    return stubs.txn_encoded


def _range(stubs: _Stubs) -> Any:
    return stubs.kv.Range


def _delete(stubs: _Stubs) -> Any:
    return stubs.kv.DeleteRange


def _stubs(channel: Any) -> _Stubs:
    encoded = channel.unary_unary(  # no request serializer: the bytes go as they are
        "/etcdserverpb.KV/Txn", response_deserializer=rpc.TxnResponse.FromString
    )
    return _Stubs(
        channel, rpc.KVStub(channel), rpc.LeaseStub(channel), rpc.WatchStub(channel), encoded
    )


class Wire:
    """The channel, stubs and credentials one backend talks through.

    :param timeout: seconds one request may take (watches are not bounded)
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.described = "etcd"
        self._stubs: _Stubs | None = None
        self._client: Any = None
        self._token: str | None = None
        self._user: tuple[str, str] | None = None
        self._limiter = Limiter(MAX_IN_FLIGHT)
        self._deletes = DeleteBatches(self._place, self._give_back, self._placed_txn)
        #: Watch streams opened so far (:meth:`watch` and :meth:`open_watch`).
        self.watch_streams = 0

    @classmethod
    def of_client(cls, client: Any, timeout: float) -> Wire:
        """A wire over an ``aetcd.Client`` (connected on first use, never closed here)."""
        wire = cls(timeout)
        wire._client = client
        wire.described = f"aetcd client {getattr(client, '_host', '?')}"
        return wire

    @classmethod
    def of_channel(
        cls, channel: Any, timeout: float, described: str, user: tuple[str, str] | None
    ) -> Wire:
        """A wire over a gRPC channel of its own (closed by :meth:`aclose`)."""
        wire = cls(timeout)
        wire._stubs = _stubs(channel)
        wire._user = user
        wire.described = described
        return wire

    @property
    def _plain(self) -> bool:
        """A channel of our own without credentials: no metadata to send, nothing to connect."""
        return self._client is None and self._user is None

    @property
    def owns_channel(self) -> bool:
        """Whether :meth:`aclose` closes the channel (not a user's client)."""
        return self._client is None

    def _metadata(self, *extra: tuple[str, str]) -> tuple[tuple[str, str], ...] | None:
        if self._client is not None:
            base = tuple(self._client.metadata or ())
        else:
            base = (("token", self._token),) if self._token else ()
        return (*base, *extra) or None

    async def _ready(self) -> _Stubs:
        if self._client is None:
            if self._stubs is None:
                raise BackendUnavailable(f"the connection to {self.described} is closed")
            return self._stubs
        try:
            await self._client.connect()
        except Exception as exc:  # aetcd raises its own ClientError family
            raise BackendUnavailable(f"etcd connect: {exc!r}") from exc
        channel = self._client.channel
        if self._stubs is None or self._stubs.channel is not channel:
            self._stubs = _stubs(channel)
        return self._stubs

    async def authenticate(self) -> None:
        """Get an auth token for the user and password given (own channels only)."""
        if self._user is None or self._stubs is None:
            return
        stub = rpc.AuthStub(self._stubs.channel)
        request = rpc.AuthenticateRequest(name=self._user[0], password=self._user[1])
        with mapped("authenticate"):
            reply = await cancellable(stub.Authenticate(request, timeout=self.timeout))
        self._token = str(reply.token)

    def _stale_token(self, exc: Any) -> bool:
        return (
            self._user is not None
            and getattr(exc.code(), "name", "") == "UNAUTHENTICATED"
            and "token" in (exc.details() or "")
        )

    async def unary(
        self, what: str, pick: Callable[[_Stubs], Any], request: Any, timeout: float | None = None
    ) -> Any:
        """Call the unary method ``pick(stubs)`` with ``request``; re-authenticate once
        if the server forgot our token; send it again, with backoff, while the server
        refuses it as "too many requests" and the ``timeout`` has not run out.

        :raises BackendError: mapped from the gRPC error
        """
        give_up = now() + (self.timeout if timeout is None else timeout)
        delay = BUSY_RETRY_MIN
        reauthenticated = False
        while True:
            stubs = await self._ready()
            try:
                return await cancellable(
                    pick(stubs)(
                        request,
                        timeout=max(give_up - now(), BUSY_RETRY_MIN),
                        metadata=self._metadata(),
                    )
                )
            except rpc.AioRpcError as exc:
                if not reauthenticated and self._stale_token(exc):
                    reauthenticated = True
                    await self.authenticate()
                    continue
                pause = delay * (0.5 + random.random())
                if not is_busy(exc) or now() + pause >= give_up:
                    raise map_rpc_error(exc, what) from exc
            except (grpc.aio.UsageError, OSError) as exc:
                raise BackendUnavailable(f"etcd {what}: {exc!r}") from exc
            await asyncio.sleep(pause)  # refused before it was proposed: nothing applied
            delay = min(delay * 2, BUSY_RETRY_MAX)

    async def _kv(self, what: str, pick: Callable[[_Stubs], Any], request: Any) -> Any:
        """A KV request, once a place among :data:`MAX_IN_FLIGHT` is free."""
        limiter = self._limiter
        if not limiter.take():
            await limiter.wait()
        try:
            return await self._placed(what, pick, request)
        finally:
            limiter.give_back()

    async def _place(self) -> None:
        """Take a place among :data:`MAX_IN_FLIGHT` (in line, if none is free)."""
        limiter = self._limiter
        if not limiter.take():
            await limiter.wait()

    def _give_back(self) -> None:
        """Give back a place taken by :meth:`_place`."""
        self._limiter.give_back()

    async def _placed_txn(self, request: Any) -> Any:
        """A ``Txn`` round trip for a caller that holds a place already."""
        return await self._placed("delete", _txn, request)

    async def _placed(self, what: str, pick: Callable[[_Stubs], Any], request: Any) -> Any:
        """A KV request, its place taken by the caller."""
        stubs = self._stubs
        if stubs is not None and self._plain:
            try:  # the hot path: a channel of our own, no token, not refused
                return await await_unary(pick(stubs)(request, timeout=self.timeout))
            except rpc.AioRpcError as exc:
                if not is_busy(exc):
                    raise map_rpc_error(exc, what) from exc
            except (grpc.aio.UsageError, OSError) as exc:
                raise BackendUnavailable(f"etcd {what}: {exc!r}") from exc
            await asyncio.sleep(BUSY_RETRY_MIN * (0.5 + random.random()))
        return await self.unary(what, pick, request)

    async def txn(self, request: Any) -> Any:
        """One ``Txn`` round trip (``request``: a ``TxnRequest``, or one serialized)."""
        return await self._kv("txn", _txn_encoded if isinstance(request, bytes) else _txn, request)

    async def range(self, request: Any) -> Any:
        """One ``Range`` round trip."""
        return await self._kv("range", _range, request)

    async def delete(self, request: Any) -> Any:
        """One ``DeleteRange`` round trip; or, while every place is taken, a place in
        the next ``Txn`` of deletes (:mod:`._deletes`). Its ``DeleteRangeResponse``."""
        limiter = self._limiter
        if limiter.free > 0 and not limiter.waiters:
            return await self._kv("delete", _delete, request)
        return await self._deletes.delete(request)

    async def lease_grant(self, ttl: int, lease_id: int, timeout: float) -> int:
        """Grant lease ``lease_id`` for ``ttl`` seconds; the TTL the server granted.

        :raises LeaseIdTaken: the id is in use
        """
        request = rpc.LeaseGrantRequest(TTL=ttl, ID=lease_id)
        reply = await self.unary("lease grant", lambda s: s.lease.LeaseGrant, request, timeout)
        if reply.error:
            raise BackendError(f"etcd lease grant: {reply.error}")
        return int(reply.TTL)

    async def lease_revoke(self, lease_id: int, timeout: float | None = None) -> bool:
        """Revoke ``lease_id``; ``False`` if the server had no such lease."""
        request = rpc.LeaseRevokeRequest(ID=lease_id)
        try:
            await self.unary("lease revoke", lambda s: s.lease.LeaseRevoke, request, timeout)
        except SessionGone:
            return False
        return True

    async def lease_keepalive(self, lease_id: int, timeout: float) -> int:
        """One keepalive of ``lease_id``; the TTL it was renewed to (0: the lease is gone)."""
        return await cancellable(self._lease_keepalive(lease_id, timeout))

    async def _lease_keepalive(self, lease_id: int, timeout: float) -> int:
        stubs = await self._ready()
        call = stubs.lease.LeaseKeepAlive(timeout=timeout, metadata=self._metadata())
        try:
            with mapped("lease keepalive"):
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                await call.done_writing()
                reply = await call.read()
        finally:
            call.cancel()
        if not isinstance(reply, rpc.LeaseKeepAliveResponse):
            raise BackendUnavailable("etcd lease keepalive: the stream ended without a reply")
        return int(reply.TTL)

    async def watch(self, create: Any, accept: Callable[[Sequence[Any]], bool]) -> None:
        """Watch as ``create`` (a ``WatchCreateRequest``) asks, until ``accept`` takes the
        events of a reply (all of them, whole revisions: etcd does not split one), or
        until the history it asks for has been compacted away.

        :raises BackendUnavailable: the member lost its leader, or the stream broke
        """
        await cancellable(self._watch(create, accept))

    async def _watch(self, create: Any, accept: Callable[[Sequence[Any]], bool]) -> None:
        stubs = await self._ready()
        call = stubs.watch.Watch(metadata=self._metadata(REQUIRE_LEADER))
        self.watch_streams += 1
        try:
            with mapped("watch"):
                await call.write(rpc.WatchRequest(create_request=create))
                while True:
                    reply = await call.read()
                    if not isinstance(reply, rpc.WatchResponse):
                        raise BackendUnavailable("etcd watch: the stream ended")
                    if reply.compact_revision:
                        return  # the caller reads the current state instead
                    if reply.canceled:
                        raise BackendUnavailable(f"etcd watch canceled: {reply.cancel_reason}")
                    if reply.events and accept(reply.events):
                        return
        finally:
            call.cancel()

    async def open_watch(self) -> Any:
        """A Watch stream to put many watchers on (see :mod:`._takeover`)."""
        stubs = await self._ready()
        call = stubs.watch.Watch(metadata=self._metadata(REQUIRE_LEADER))
        self.watch_streams += 1
        return call

    async def write_watch(self, call: Any, request: Any) -> None:
        """Send one ``WatchRequest`` on a stream from :meth:`open_watch`.

        :raises BackendUnavailable: the stream has ended
        """
        with mapped("watch"):
            try:
                await call.write(request)
            except asyncio.InvalidStateError as exc:
                raise BackendUnavailable(f"etcd watch: {exc}") from exc

    async def read_watch(self, call: Any) -> Any:
        """The next ``WatchResponse`` on a stream from :meth:`open_watch`, read by a
        background task of the backend (:func:`._aio.read_owned`).

        :raises BackendUnavailable: the stream ended or broke
        """
        with mapped("watch"):
            reply = await read_owned(call)  # CallCancelled if the stream was
        if not isinstance(reply, rpc.WatchResponse):
            raise BackendUnavailable("etcd watch: the stream ended")
        return reply

    @property
    def delete_batches(self) -> int:
        """``Txn`` requests sent so far that carried several deletes."""
        return self._deletes.batches

    async def aclose(self) -> None:
        """Close the channel if it is ours. Idempotent."""
        await self._deletes.aclose()
        stubs, self._stubs = self._stubs, None
        if stubs is not None and self.owns_channel:
            with mapped("close"):
                await stubs.channel.close()
