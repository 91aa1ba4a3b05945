"""A lean RESP2 client for the Redis backend's own commands, with hiredis's parser.

redis-py's asyncio client spends about 100 µs of CPU per command in its own stack
(connection pool, retries, event dispatch, a task per ``wait_for``): more than the
round trip to a loopback server, and five times what the same command costs over a
bare protocol. A backend made from a ``redis://`` or ``unix://`` URL therefore sends
its commands through this module instead (TLS, RESP3, credential providers, Cluster,
Sentinel and clients the user passed in keep redis-py). The backend's pub/sub
connection is a lean one too (:class:`Subscriber`): every reply goes to its listener.

**One shared connection, pipelined.** Every command of the backend goes
over one connection: each caller writes its command and waits for its own reply, in
order. A caller that is cancelled, or times out, leaves its place in the queue, and its
reply is dropped when it arrives, so cancellation is immediate and never lost (unlike
redis-py's, see :mod:`aiolease.backends._asyncio`) and the stream stays in step.
As with any client, a command cancelled after it was written may still run.

A timeout closes the connection (it is suspect); a lost connection fails what it
carried with :class:`redis.exceptions.ConnectionError`. The next command connects
again. Errors are redis-py's types, so the backend maps them in one place.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import hiredis
from redis.exceptions import AuthenticationError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._asyncio import timeout_after
from ._url import Endpoint

__all__ = ["LeanClient", "Sent", "Subscriber"]


def _error(message: str) -> ResponseError:
    """An error reply (also one inside an array reply) as redis-py's exception."""
    if message.startswith("NOSCRIPT"):
        return NoScriptError(message)
    return ResponseError(message)


def _drop(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: asyncio does not log it as lost


class _Connection(asyncio.Protocol):
    """One socket: commands written in order, replies handed back in order."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader(replyError=_error)
        self.pending: deque[asyncio.Future[Any]] = deque()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        #: Given every reply nobody waits for (a subscriber's messages), when set.
        self.push: Callable[[Any], None] | None = None
        #: Fails when the connection is lost or closed (a subscriber awaits it).
        self.ended: asyncio.Future[None] | None = None
        #: Writes made after the first one of this loop pass, written together at its
        #: end (see :meth:`send`), and whether that write is scheduled.
        self._later: list[bytes] = []
        self._flushing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while self.pending or self.push is not None:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self.close(RedisConnectionError(f"Redis sent a malformed reply: {exc}"))
                return
            if reply is False:
                return
            if not self.pending:
                assert self.push is not None
                self.push(reply)
                continue
            future = self.pending.popleft()
            if not future.done():
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(RedisConnectionError(f"Connection to Redis lost: {exc or 'closed'}"))

    def _fail(self, error: BaseException) -> None:
        if self.ended is not None and not self.ended.done():
            self.ended.set_exception(error)
            self.ended.add_done_callback(_drop)
        while self.pending:
            future = self.pending.popleft()
            if not future.done():
                future.set_exception(error)
                future.add_done_callback(_drop)

    def send(self, payload: bytes, count: int) -> list[asyncio.Future[Any]]:
        """Write ``count`` packed commands; the futures of their replies.

        The first write of a loop pass goes out at once; the later ones of the same
        pass are written together once the pass ends (one system call instead of
        one each: many tasks releasing at once, say), still in order.
        """
        if self.closed or self.transport is None:
            raise RedisConnectionError("the Redis connection is closed")
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(count)]
        self.pending.extend(futures)
        if self._flushing:
            self._later.append(payload)
        else:
            self.transport.write(payload)
            self._flushing = True
            loop.call_soon(self._flush)
        return futures

    def _flush(self) -> None:
        self._flushing = False
        later, self._later = self._later, []
        if later and not self.closed and self.transport is not None:
            self.transport.write(b"".join(later))

    def close(self, error: BaseException | None = None) -> None:
        self.closed = True
        self.push = None
        self._fail(error or RedisConnectionError("the Redis connection was closed"))
        if self.transport is not None:
            self.transport.close()


class Subscriber:
    """A lean connection in pub/sub mode: commands are written without waiting, and
    every reply (confirmations, messages, pongs) goes to the listener.

    Made by :meth:`LeanClient.subscriber`; never reconnects.
    """

    def __init__(self, client: LeanClient, conn: _Connection) -> None:
        self._client = client
        self._conn = conn

    @property
    def alive(self) -> bool:
        """Whether the connection is still open."""
        return not self._conn.closed

    def write(self, commands: Sequence[Sequence[Any]]) -> None:
        """Send ``commands`` (their replies go to the listener).

        :raises redis.exceptions.ConnectionError: the connection is closed
        """
        conn = self._conn
        if conn.closed or conn.transport is None:
            raise RedisConnectionError("the Redis connection is closed")
        conn.transport.write(b"".join(hiredis.pack_command(tuple(c)) for c in commands))

    async def listen(self, dispatch: Callable[[Any], None]) -> None:
        """Give each reply to ``dispatch`` (in the protocol's callback: no task hop)
        until the connection fails, which this raises.

        :raises redis.exceptions.ConnectionError: the connection was lost or closed
        :raises redis.exceptions.ResponseError: the server refused a command (the
            connection is then closed)
        """
        conn = self._conn
        conn.ended = asyncio.get_running_loop().create_future()
        if conn.closed:
            raise RedisConnectionError("the Redis connection is closed")

        def deliver(reply: Any) -> None:
            if isinstance(reply, ResponseError):  # a refused SUBSCRIBE, say: give up
                conn.close(reply)
            else:
                dispatch(reply)

        conn.push = deliver
        conn.data_received(b"")  # replies that came before the listener
        try:
            await conn.ended
        finally:
            conn.push = None

    def close(self) -> None:
        """Close the connection. Idempotent."""
        self._client._discard(self._conn)


def _expire(future: asyncio.Future[Any], expiry: type[Exception]) -> None:
    if not future.done():
        future.set_exception(expiry("Timeout reading from Redis"))


class LeanClient:
    """Commands over lean connections to one server (see the module docstring).

    :param endpoint: where to connect, and the timeouts
    """

    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint
        self._shared: _Connection | None = None
        self._connecting: asyncio.Lock | None = None
        self._open: set[_Connection] = set()
        self._closed = False

    async def _connect(self) -> _Connection:
        if self._closed:
            raise RedisConnectionError("the client is closed")
        e = self._endpoint
        loop = asyncio.get_running_loop()
        try:
            if e.path is not None:
                make = loop.create_unix_connection(_Connection, e.path)
            else:
                make = loop.create_connection(_Connection, e.host or "localhost", e.port)
            # Not asyncio.wait_for, which up to 3.11 can drop a cancellation that comes
            # as the connection is made (and go on to use it).
            async with timeout_after(e.connect_timeout):
                _, conn = await make
        except (OSError, asyncio.TimeoutError) as exc:
            where = e.path or f"{e.host}:{e.port}"
            raise RedisConnectionError(f"Error connecting to Redis at {where}: {exc!r}") from exc
        self._open.add(conn)
        try:
            await self._hello(conn)
        except BaseException:
            self._discard(conn)
            raise
        return conn

    async def _hello(self, conn: _Connection) -> None:
        e = self._endpoint
        commands: list[tuple[Any, ...]] = []
        if e.password is not None:
            commands.append(
                ("AUTH", e.username, e.password) if e.username else ("AUTH", e.password)
            )
        if e.client_name:
            commands.append(("CLIENT", "SETNAME", e.client_name))
        if e.db:
            commands.append(("SELECT", e.db))
        if not commands:
            return
        replies = await self._send(conn, commands, e.connect_timeout)
        for command, reply in zip(commands, replies, strict=True):
            if isinstance(reply, ResponseError):
                raise AuthenticationError(str(reply)) if command[0] == "AUTH" else reply

    def _discard(self, conn: _Connection) -> None:
        conn.close()
        self._open.discard(conn)
        if self._shared is conn:
            self._shared = None

    async def _send(
        self,
        conn: _Connection,
        commands: Sequence[Sequence[Any]],
        timeout: float | None,
        expiry: type[Exception] = RedisTimeoutError,
    ) -> list[Any]:
        """Send ``commands`` in one write; their replies (an error reply as a
        :class:`ResponseError` value). A timeout raises ``expiry`` and closes the
        connection."""
        futures = conn.send(_packed(commands), len(commands))
        return await self._replies(conn, futures, timeout, expiry)

    def send_now(self, commands: Sequence[Sequence[Any]]) -> Sent | None:
        """Write ``commands`` in one write on the shared connection before returning,
        if it is open (``None``: it is not); :meth:`replies` awaits their replies."""
        conn = self._shared
        if conn is None or conn.closed or conn.transport is None:
            return None
        return Sent(conn, conn.send(_packed(commands), len(commands)))

    async def replies(self, sent: Sent) -> list[Any]:
        """The replies to what :meth:`send_now` sent, as :meth:`execute_many` returns
        them."""
        return await self._replies(sent.conn, sent.futures, self._endpoint.timeout)

    async def _replies(
        self,
        conn: _Connection,
        futures: list[asyncio.Future[Any]],
        timeout: float | None,
        expiry: type[Exception] = RedisTimeoutError,
    ) -> list[Any]:
        last = futures[-1]
        timer = None
        if timeout is not None:
            timer = asyncio.get_running_loop().call_later(timeout, _expire, last, expiry)
        try:
            await last  # replies come in order: the others are in by now
        except expiry:
            self._discard(conn)
            raise
        except asyncio.CancelledError:
            for future in futures:
                future.cancel()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return [_result(future) for future in futures]

    async def _shared_connection(self) -> _Connection:
        conn = self._shared
        if conn is not None and not conn.closed:
            return conn
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._shared is None or self._shared.closed:
                if self._shared is not None:
                    self._open.discard(self._shared)
                self._shared = await self._connect()
            return self._shared

    async def execute(self, *args: Any) -> Any:
        """One command on the shared connection.

        :raises redis.exceptions.RedisError: an error reply, a timeout, a lost connection
        """
        conn = self._shared
        if conn is None or conn.closed:
            conn = await self._shared_connection()
        (reply,) = await self._send(conn, [args], self._endpoint.timeout)
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def execute_many(
        self, commands: Sequence[Sequence[Any]], *, raise_on_error: bool = False
    ) -> list[Any]:
        """Commands pipelined in one write on the shared connection; their replies, an
        error reply as a :class:`ResponseError` value unless ``raise_on_error``."""
        conn = await self._shared_connection()
        replies = await self._send(conn, commands, self._endpoint.timeout)
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, ResponseError):
                    raise reply
        return replies

    async def subscriber(self) -> Subscriber:
        """A new connection for pub/sub.

        :raises redis.exceptions.RedisError: it could not connect
        """
        return Subscriber(self, await self._connect())

    async def aclose(self) -> None:
        """Close every connection. Idempotent."""
        self._closed = True
        for conn in list(self._open):
            self._discard(conn)


@dataclass(frozen=True)
class Sent:
    """Commands written on a connection, and the futures of their replies."""

    conn: _Connection
    futures: list[asyncio.Future[Any]]


def _packed(commands: Sequence[Sequence[Any]]) -> bytes:
    if len(commands) == 1:
        packed: bytes = hiredis.pack_command(tuple(commands[0]))
        return packed
    return b"".join([hiredis.pack_command(tuple(c)) for c in commands])


def _result(future: asyncio.Future[Any]) -> Any:
    error = future.exception()
    if error is not None:
        raise error
    return future.result()
