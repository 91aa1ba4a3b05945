"""What the Redlock tests share: the instances' keys, and a router that lets the safety
harness cut a worker off from *all* instances with its one blackhole proxy.

The harness gives every worker one :class:`~aiolease.testing.proxy.FaultProxy` in
front of the one server its URL names. For Redlock that server is a
:class:`RespRouter`: each connection a worker opens names the instance it wants in
its first command (with RESP2, redis-py sends ``CLIENT SETNAME`` before anything else), and the
router joins it to that instance, passing every byte on unchanged. So blackholing a
worker's proxy cuts it off from every instance at once, as a network partition of
that host would, while the other workers still reach all of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import anyio
import redis
import redis.asyncio
from anyio.abc import SocketStream, TaskGroup

from aiolease.backends.redlock import RedlockBackend
from tests.backends.redis.support import delete_under

__all__ = [
    "ROUTE",
    "RespRouter",
    "RoutedRedlock",
    "Stubborn",
    "instance_clients",
    "instances_of",
    "lease_keys",
    "wipe",
]

#: The client name that asks the router for instance ``i``: ``ROUTE + str(i)``.
ROUTE = "redlock-route-"
_MAX_FIRST_COMMAND = 4096


def lease_keys(endpoints: Sequence[tuple[str, int]], prefix: str) -> dict[int, list[bytes]]:
    """Every instance's lease keys under ``prefix`` (token counters are not listed)."""
    found: dict[int, list[bytes]] = {}
    for index, (host, port) in enumerate(endpoints):
        with redis.Redis(host=host, port=port) as client:
            found[index] = sorted(client.scan_iter(match=f"{prefix}*:lease", count=1000))
    return found


def wipe(endpoints: Sequence[tuple[str, int]], prefix: str) -> None:
    """Delete every key under ``prefix`` on every instance."""
    delete_under(prefix, (redis.Redis(host=host, port=port) for host, port in endpoints))


@asynccontextmanager
async def instance_clients(
    endpoints: Sequence[tuple[str, int]],
) -> AsyncIterator[list[redis.asyncio.Redis]]:
    """A ``redis.asyncio`` client of each instance (asyncio only), closed afterwards."""
    clients = [redis.asyncio.Redis(host=host, port=port) for host, port in endpoints]
    try:
        yield clients
    finally:
        for client in clients:
            await client.aclose()


def _first_command(data: bytes) -> list[bytes] | None:
    """The first RESP command in ``data``, or ``None`` if it is not complete yet.

    :raises ValueError: ``data`` does not start with a RESP array of bulk strings
    """
    if not data.startswith(b"*"):
        raise ValueError(f"not a RESP command: {data[:40]!r}")
    *lines, _rest = data.split(b"\r\n")  # the last piece may be incomplete
    if not lines:
        return None
    count, at = int(lines[0][1:]), 1
    parts: list[bytes] = []
    while len(parts) < count:
        if at + 1 >= len(lines):
            return None
        size, value = lines[at], lines[at + 1]
        if not size.startswith(b"$") or len(value) != int(size[1:]):
            raise ValueError(f"not a RESP command: {data[:40]!r}")
        parts.append(value)
        at += 2
    return parts


class RespRouter:
    """A TCP endpoint that joins each connection to the instance its client name picks.

    :param instances: ``(host, port)`` of each instance, in route order
    """

    def __init__(self, instances: Sequence[tuple[str, int]]) -> None:
        self._instances = list(instances)
        self._stack = AsyncExitStack()
        self.port = 0
        self.routed = [0] * len(self._instances)

    def url(self, **query: Any) -> str:
        """The URL a :class:`RoutedRedlock` opens through this router."""
        extra = "".join(f"&{k}={v}" for k, v in query.items())
        return f"redis+redlock://127.0.0.1:{self.port}?routes={len(self._instances)}{extra}"

    async def __aenter__(self) -> RespRouter:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = int(listener.extra(anyio.abc.SocketAttribute.local_port))
        self._stack.push_async_callback(listener.aclose)  # once the task group has ended
        self._group: TaskGroup = await self._stack.enter_async_context(anyio.create_task_group())
        self._group.start_soon(listener.serve, self._serve)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._group.cancel_scope.cancel()
        await self._stack.__aexit__(exc_type, exc, tb)

    async def _serve(self, client: SocketStream) -> None:
        try:
            await self._join(client)
        except (ValueError, OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # this connection only: the client sees it closed

    async def _join(self, client: SocketStream) -> None:
        async with client:
            data = b""
            command = None
            while command is None:
                try:
                    data += await client.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return
                command = _first_command(data)
                if len(data) > _MAX_FIRST_COMMAND:
                    return
            index = _route(command)
            self.routed[index] += 1
            host, port = self._instances[index]
            try:
                upstream = await anyio.connect_tcp(host, port)
            except OSError:
                return
            async with upstream, anyio.create_task_group() as tg:
                await upstream.send(data)
                tg.start_soon(_pipe, client, upstream, tg)
                tg.start_soon(_pipe, upstream, client, tg)


def _route(command: list[bytes]) -> int:
    words = [part.decode() for part in command]
    if len(words) != 3 or words[0].upper() != "CLIENT" or words[1].upper() != "SETNAME":
        raise ValueError(f"the first command must be CLIENT SETNAME {ROUTE}<n>, not {words}")
    if not words[2].startswith(ROUTE):
        raise ValueError(f"client name {words[2]!r} names no route")
    return int(words[2][len(ROUTE) :])


async def _pipe(source: SocketStream, sink: SocketStream, tg: TaskGroup) -> None:
    try:
        async for chunk in source:
            await sink.send(chunk)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass
    tg.cancel_scope.cancel()


class RoutedRedlock(RedlockBackend):
    """A Redlock whose instances are all reached through one :class:`RespRouter` address
    (``redis+redlock://host:port?routes=N``), for the safety harness's blackhole runs."""

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> RoutedRedlock:
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        routes = int(query.pop("routes"))
        assert parts.hostname is not None and parts.port is not None, url
        clients = [
            redis.asyncio.Redis(
                host=parts.hostname,
                port=parts.port,
                client_name=f"{ROUTE}{i}",
                db=i,  # one address for all: the database tells them apart for the backend
                protocol=2,  # RESP3 would send HELLO first, and wait for its reply
                socket_timeout=5.0,
                socket_connect_timeout=5.0,
            )
            for i in range(routes)
        ]
        backend = cls(clients, **query, **options)
        try:
            await backend.ping()
        except BaseException:
            await backend.aclose()
            raise
        return backend

    async def aclose(self) -> None:
        """Close the backend, then the clients it made."""
        try:
            await super().aclose()
        finally:
            for client in self.clients:
                await client.aclose()


class Stubborn(redis.asyncio.Redis):
    """A client whose commands ignore a cancellation and run on to their reply or their
    socket timeout, as redis-py's (8.1) now and then do (see
    :mod:`aiolease.backends._asyncio`): here always, so that a test can count on it."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        command = asyncio.ensure_future(super().execute_command(*args, **options))  # type: ignore[no-untyped-call]
        while not command.done():
            try:
                await asyncio.wait([command])
            except asyncio.CancelledError:
                pass  # lost, as redis-py loses one
        return command.result()


def instances_of(url: str) -> Iterator[tuple[str, int]]:
    """The ``(host, port)`` of each instance a Redlock URL names."""
    for item in urlsplit(url).netloc.rpartition("@")[2].split(","):
        host, _, port = item.rpartition(":")
        yield host.strip("[]"), int(port)
