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
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from aetcd import rpc

from ..._exceptions import BackendError, BackendTimeout, BackendUnavailable, InvalidArgument
from ._aio import await_unary, cancellable

__all__ = ["LeaseIdTaken", "SessionGone", "Wire", "grpc_target", "is_ip", "map_rpc_error", "mapped"]

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


def _txn(stubs: _Stubs) -> Any:
    return stubs.kv.Txn


def _range(stubs: _Stubs) -> Any:
    return stubs.kv.Range


def _delete(stubs: _Stubs) -> Any:
    return stubs.kv.DeleteRange


def _stubs(channel: Any) -> _Stubs:
    return _Stubs(channel, rpc.KVStub(channel), rpc.LeaseStub(channel), rpc.WatchStub(channel))


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
        if the server forgot our token.

        :raises BackendError: mapped from the gRPC error
        """
        for attempt in (1, 2):
            stubs = await self._ready()
            try:
                return await cancellable(
                    pick(stubs)(
                        request,
                        timeout=self.timeout if timeout is None else timeout,
                        metadata=self._metadata(),
                    )
                )
            except rpc.AioRpcError as exc:
                if attempt == 1 and self._stale_token(exc):
                    await self.authenticate()
                    continue
                raise map_rpc_error(exc, what) from exc
            except (grpc.aio.UsageError, OSError) as exc:
                raise BackendUnavailable(f"etcd {what}: {exc!r}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def txn(self, request: Any) -> Any:
        """One ``Txn`` round trip."""
        stubs = self._stubs
        if stubs is None or not self._plain:
            return await self.unary("txn", _txn, request)
        try:  # the hot path: a channel of our own, no token
            return await await_unary(stubs.kv.Txn(request, timeout=self.timeout))
        except rpc.AioRpcError as exc:
            raise map_rpc_error(exc, "txn") from exc
        except (grpc.aio.UsageError, OSError) as exc:
            raise BackendUnavailable(f"etcd txn: {exc!r}") from exc

    async def range(self, request: Any) -> Any:
        """One ``Range`` round trip."""
        return await self.unary("range", _range, request)

    async def delete(self, request: Any) -> Any:
        """One ``DeleteRange`` round trip."""
        stubs = self._stubs
        if stubs is None or not self._plain:
            return await self.unary("delete", _delete, request)
        try:  # the hot path, as in txn
            return await await_unary(stubs.kv.DeleteRange(request, timeout=self.timeout))
        except rpc.AioRpcError as exc:
            raise map_rpc_error(exc, "delete") from exc
        except (grpc.aio.UsageError, OSError) as exc:
            raise BackendUnavailable(f"etcd delete: {exc!r}") from exc

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

    async def watch(self, create: Any, accept: Callable[[Any], bool]) -> None:
        """Watch as ``create`` (a ``WatchCreateRequest``) asks, until an event that
        ``accept`` takes, or until the history it asks for has been compacted away.

        :raises BackendUnavailable: the member lost its leader, or the stream broke
        """
        await cancellable(self._watch(create, accept))

    async def _watch(self, create: Any, accept: Callable[[Any], bool]) -> None:
        stubs = await self._ready()
        call = stubs.watch.Watch(metadata=self._metadata(REQUIRE_LEADER))
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
                    if any(accept(event) for event in reply.events):
                        return
        finally:
            call.cancel()

    async def open_watch(self) -> Any:
        """A Watch stream to put many watchers on (see :mod:`._takeover`)."""
        stubs = await self._ready()
        return stubs.watch.Watch(metadata=self._metadata(REQUIRE_LEADER))

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
        """The next ``WatchResponse`` on a stream from :meth:`open_watch`.

        :raises BackendUnavailable: the stream ended or broke
        """
        with mapped("watch"):
            reply = await cancellable(call.read())  # CallCancelled if the stream was
        if not isinstance(reply, rpc.WatchResponse):
            raise BackendUnavailable("etcd watch: the stream ended")
        return reply

    async def aclose(self) -> None:
        """Close the channel if it is ours. Idempotent."""
        stubs, self._stubs = self._stubs, None
        if stubs is not None and self.owns_channel:
            with mapped("close"):
                await stubs.channel.close()
