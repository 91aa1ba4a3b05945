"""FaultProxy: a TCP proxy between a client and its server that misbehaves on command.

A test puts one proxy per client in front of a real server, points the client at
it, and switches its mode at run time; every switch returns once it is in force::

    async with FaultProxy("127.0.0.1", 6379) as proxy:
        client = redis.Redis.from_url(proxy.url_for("redis://127.0.0.1:6379/0"))
        await proxy.delay(0.2)      # each chunk arrives 0.2 s after it was read, both ways
        await proxy.blackhole()     # nothing moves; what was held is delivered on a later switch
        await proxy.reset()         # RST every connection, and each new one at once
        await proxy.refuse()        # stop listening (ECONNREFUSED); open connections carry on
        await proxy.pass_through()  # heal

Each connection has two directions; each direction is a reader and a writer::

    source --> reader --(due, chunk)--> queue of held chunks --> writer --> sink
               due = read time + latency                          sends at due, unless
                                                                  blackholed: then waits

The reader never waits for the writer, so chunks in flight are pipelined like
bits on a long wire: a delay adds latency, it does not cut throughput to one
chunk per latency. A direction holds at most :data:`MAX_HELD_CHUNKS` chunks;
then it stops reading and TCP pushes back on the sender. The end of a stream
travels the same way: a half-close is forwarded as a half-close and a reset
(RST) as a reset, each after the chunks before it.

Under REFUSE the listening sockets are closed, so connects get ECONNREFUSED; the
port stays bound (not listening) by a placeholder socket, so that no outgoing
connection's ephemeral port takes it before the proxy listens again.
"""

from __future__ import annotations

import enum
import errno
import socket
import struct
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast, final
from urllib.parse import urlsplit, urlunsplit

import anyio
from anyio.abc import SocketAttribute, SocketListener, SocketStream, TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..._exceptions import InvalidArgument
from ..._urls import redact
from ..._validate import check_seconds

if TYPE_CHECKING:
    from anyio.streams.stapled import MultiListener

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

__all__ = ["CHUNK_SIZE", "MAX_HELD_CHUNKS", "FaultProxy", "ProxyMode", "ProxyStatistics"]

#: The most bytes read from a socket at once: one chunk.
CHUNK_SIZE = 65536
#: The most chunks one direction of a connection holds (delayed or blackholed).
MAX_HELD_CHUNKS = 256
#: accept() errors that mean "out of resources for now": wait and accept again.
_ACCEPT_RETRY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_ACCEPT_BACKOFF = 0.1


class ProxyMode(str, enum.Enum):
    """What a :class:`FaultProxy` does with traffic."""

    #: Forward everything at once.
    PASS = "pass"
    #: Forward each chunk ``latency`` seconds after it was read, in both directions.
    DELAY = "delay"
    #: Accept connections but forward nothing, in either direction; hold it until a switch.
    BLACKHOLE = "blackhole"
    #: Reset (RST) every open connection, and every new one at once.
    RESET = "reset"
    #: Stop listening: connects are refused. Open connections forward at once (what a
    #: blackhole held is delivered).
    REFUSE = "refuse"


@final
@dataclass(frozen=True, slots=True)
class ProxyStatistics:
    """A snapshot of one :class:`FaultProxy`.

    :param mode: the mode in force
    :param latency: the delay in seconds (0 unless the mode is DELAY)
    :param connections: client connections open now
    :param accepted: client connections accepted since the proxy started
    :param bytes_to_target: bytes handed on from clients to the target
    :param bytes_to_client: bytes handed on from the target to clients
    :param held_bytes: bytes read but not yet delivered (delayed or blackholed), now
    :param max_held_bytes: the most bytes held at once since the proxy started
    """

    mode: ProxyMode
    latency: float
    connections: int
    accepted: int
    bytes_to_target: int
    bytes_to_client: int
    held_bytes: int
    max_held_bytes: int


class _End(enum.Enum):
    """How a source ended; travels in the queue after the source's last chunk."""

    EOF = "eof"  # half-closed: half-close the sink
    RESET = "reset"  # broken or reset: reset the whole connection


#: A chunk (or the end of its stream) and the time it is due at the sink.
_Held = tuple[float, bytes | _End]


@dataclass(eq=False)
class _Flow:
    """One direction of one connection."""

    source: SocketStream
    sink: SocketStream
    to_target: bool
    held: int = 0  # bytes read from source, not yet delivered to sink


class _Connection:
    """One client connection and its upstream connection to the target."""

    def __init__(self, client: SocketStream) -> None:
        self.client = client
        self.upstream: SocketStream | None = None
        self.scope = anyio.CancelScope()
        self.aborted = False
        self.closed = anyio.Event()

    def abort(self) -> None:
        """Stop forwarding; both sockets will be closed with a reset."""
        self.aborted = True
        self.scope.cancel()

    async def aclose(self) -> None:
        """Close both sockets, with RST if aborted; shielded, as it must finish."""
        with anyio.CancelScope(shield=True):
            for stream in (self.client, self.upstream):
                if stream is not None:
                    if self.aborted:
                        _linger_zero(stream)
                    await stream.aclose()
        self.closed.set()


class _Acceptor:
    """The accept loop of one listener, stoppable from another task."""

    def __init__(self, listener: MultiListener[SocketStream]) -> None:
        self.listener = listener
        self.scope = anyio.CancelScope()
        self.started = False
        self.stopped = anyio.Event()

    async def stop(self) -> None:
        """Stop accepting and close the listening sockets."""
        self.scope.cancel()
        if self.started:
            await self.stopped.wait()
        await self.listener.aclose()


class FaultProxy:
    """Forwards TCP connections to ``target_host:target_port``, with faults on command.

    Use it as an async context manager: it listens on entry (``port=0`` picks a free
    port; read it from :attr:`port`) and closes every connection on exit. Modes are
    per proxy: run one proxy per client to cut one client off while others still
    reach the server.

    :param target_host: the server's host
    :param target_port: the server's port
    :param host: the address to listen on
    :param port: the port to listen on, 0 for any free one
    :raises InvalidArgument: a host is not a non-empty str, or a port is out of range
    """

    # Created on entry, where an event loop runs.
    _changed: anyio.Event  # set and replaced on every switch
    _switching: anyio.Lock
    _task_group: TaskGroup
    _exit_stack: AsyncExitStack

    def __init__(
        self, target_host: str, target_port: int, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self._target_host = _check_host("target_host", target_host)
        self._target_port = _check_port("target_port", target_port, lowest=1)
        self._host = _check_host("host", host)
        self._port = _check_port("port", port, lowest=0)
        self._mode = ProxyMode.PASS
        self._latency = 0.0
        self._running = False
        self._connections: set[_Connection] = set()
        self._acceptor: _Acceptor | None = None
        self._placeholders: list[socket.socket] = []
        self._accepted = 0
        self._to_target = 0
        self._to_client = 0
        self._held = 0
        self._max_held = 0

    def __repr__(self) -> str:
        return (
            f"<FaultProxy {self._host}:{self._port} -> {self._target_host}:{self._target_port}"
            f" {self._mode.value}>"
        )

    @property
    def host(self) -> str:
        """The address the proxy listens on."""
        return self._host

    @property
    def port(self) -> int:
        """The port the proxy listens on (the same one again after REFUSE).

        :raises RuntimeError: the port was 0 and the proxy has not started yet
        """
        if self._port == 0:
            raise RuntimeError("the proxy picks its port when it starts: use it in `async with`")
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` of the proxy (``[host]:port`` for IPv6)."""
        return f"{_bracket(self._host)}:{self.port}"

    @property
    def target(self) -> tuple[str, int]:
        """``(host, port)`` of the server behind the proxy."""
        return self._target_host, self._target_port

    @property
    def mode(self) -> ProxyMode:
        """The mode in force."""
        return self._mode

    @property
    def latency(self) -> float:
        """The delay in seconds (0 unless :attr:`mode` is DELAY)."""
        return self._latency

    def url_for(self, url: str) -> str:
        """``url`` with its ``host:port`` replaced by the proxy's; user, path and query kept.

        :raises InvalidArgument: ``url`` has no host, or several (``host1,host2``)
        """
        parts = urlsplit(url)
        userinfo, at, hosts = parts.netloc.rpartition("@")
        if not parts.scheme or not hosts:
            raise InvalidArgument(f"expected a URL with a host, got {redact(url)!r}")
        if "," in hosts:
            raise InvalidArgument(f"a proxy stands for one server; {redact(url)!r} names several")
        return urlunsplit(parts._replace(netloc=f"{userinfo}{at}{self.address}"))

    def statistics(self) -> ProxyStatistics:
        """A snapshot of the mode and the traffic so far."""
        return ProxyStatistics(
            mode=self._mode,
            latency=self._latency,
            connections=len(self._connections),
            accepted=self._accepted,
            bytes_to_target=self._to_target,
            bytes_to_client=self._to_client,
            held_bytes=self._held,
            max_held_bytes=self._max_held,
        )

    async def pass_through(self) -> None:
        """Forward everything at once; deliver what a blackhole held."""
        await self.set_mode(ProxyMode.PASS)

    async def delay(self, latency: float) -> None:
        """Deliver each chunk read from now on ``latency`` seconds after it was read.

        :raises InvalidArgument: ``latency`` is negative or not finite
        """
        await self.set_mode(ProxyMode.DELAY, latency)

    async def blackhole(self) -> None:
        """Forward nothing on open and new connections, until another mode is set."""
        await self.set_mode(ProxyMode.BLACKHOLE)

    async def reset(self) -> None:
        """Reset every open connection (RST) and, until another mode is set, each new one."""
        await self.set_mode(ProxyMode.RESET)

    async def refuse(self) -> None:
        """Stop listening until another mode is set; open connections forward at once."""
        await self.set_mode(ProxyMode.REFUSE)

    async def set_mode(self, mode: ProxyMode | str, latency: float = 0.0) -> None:
        """Switch to ``mode`` (a :class:`ProxyMode` or its value); return once it is in force.

        Leaving REFUSE listens again on the same port; RESET returns once every open
        connection is closed. A switch is shielded from cancellation, so that the
        proxy is never left half-way.

        :param latency: seconds, for DELAY only
        :raises InvalidArgument: unknown mode, or a bad latency
        :raises OSError: leaving REFUSE, the port could not be bound again
        :raises RuntimeError: the proxy is not running
        """
        try:
            mode = ProxyMode(mode)
        except ValueError:
            modes = ", ".join(m.value for m in ProxyMode)
            raise InvalidArgument(f"unknown mode {mode!r}; one of {modes}") from None
        latency = check_seconds("latency", latency, allow_zero=True)
        if latency and mode is not ProxyMode.DELAY:
            raise InvalidArgument(f"latency applies to DELAY only, not {mode.value}")
        if not self._running:
            raise RuntimeError("the proxy is not running: use it in `async with`")
        with anyio.CancelScope(shield=True):
            async with self._switching:
                await self._switch(mode, latency)

    async def _switch(self, mode: ProxyMode, latency: float) -> None:
        old = self._mode
        if old is ProxyMode.REFUSE and mode is not ProxyMode.REFUSE:
            self._accept(await self._listen())
        self._mode, self._latency = mode, latency
        self._changed.set()
        self._changed = anyio.Event()
        if mode is ProxyMode.REFUSE and old is not ProxyMode.REFUSE:
            await self._stop_listening()
        if mode is ProxyMode.RESET:
            connections = list(self._connections)
            for connection in connections:
                connection.abort()
            for connection in connections:
                await connection.closed.wait()

    async def __aenter__(self) -> Self:
        if self._running:
            raise RuntimeError("this FaultProxy is already running")
        self._mode, self._latency = ProxyMode.PASS, 0.0
        self._accepted = self._to_target = self._to_client = self._held = self._max_held = 0
        self._changed = anyio.Event()
        self._switching = anyio.Lock()
        async with AsyncExitStack() as stack:
            stack.push_async_callback(self._close_listening)
            acceptor = await self._listen()  # before the task group: an OSError comes out bare
            self._task_group = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(self._task_group.cancel_scope.cancel)
            self._accept(acceptor)
            self._exit_stack = stack.pop_all()
        self._running = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        self._running = False
        return await self._exit_stack.__aexit__(exc_type, exc_value, traceback)

    async def _listen(self) -> _Acceptor:
        """Bind the listening sockets: on :attr:`port` again, or on a new one if it is 0."""
        self._close_placeholders()
        listener = await anyio.create_tcp_listener(local_host=self._host, local_port=self._port)
        self._port = listener.extra(SocketAttribute.local_port)
        self._acceptor = _Acceptor(listener)
        return self._acceptor

    def _accept(self, acceptor: _Acceptor) -> None:
        acceptor.started = True
        self._task_group.start_soon(self._accept_loop, acceptor)

    async def _stop_listening(self) -> None:
        if self._acceptor is None:
            return
        acceptor, self._acceptor = self._acceptor, None
        bound = [
            listener.extra(SocketAttribute.raw_socket) for listener in acceptor.listener.listeners
        ]
        addresses = [(sock.family, sock.getsockname()) for sock in bound]
        await acceptor.stop()
        placeholders = (_placeholder(family, address) for family, address in addresses)
        self._placeholders = [p for p in placeholders if p is not None]

    async def _close_listening(self) -> None:
        with anyio.CancelScope(shield=True):
            if self._acceptor is not None:
                await self._acceptor.stop()
                self._acceptor = None
        self._close_placeholders()

    def _close_placeholders(self) -> None:
        for placeholder in self._placeholders:
            placeholder.close()
        self._placeholders = []

    async def _accept_loop(self, acceptor: _Acceptor) -> None:
        try:
            with acceptor.scope:
                async with anyio.create_task_group() as tg:
                    for listener in acceptor.listener.listeners:
                        # create_tcp_listener() makes one SocketListener per address
                        tg.start_soon(self._accept_from, cast(SocketListener, listener))
        finally:
            acceptor.stopped.set()

    async def _accept_from(self, listener: SocketListener) -> None:
        while True:
            try:
                client = await listener.accept()
            except OSError as exc:
                if exc.errno not in _ACCEPT_RETRY_ERRNOS:
                    raise
                await anyio.sleep(_ACCEPT_BACKOFF)
                continue
            self._task_group.start_soon(self._handle, client)

    async def _handle(self, client: SocketStream) -> None:
        connection = _Connection(client)
        self._accepted += 1
        self._connections.add(connection)
        try:
            if self._mode is ProxyMode.RESET:
                connection.abort()
            else:
                with connection.scope:
                    await self._serve(connection)
        finally:
            self._connections.discard(connection)
            await connection.aclose()

    async def _serve(self, connection: _Connection) -> None:
        await self._wait_flowing()  # a partition holds the connect too
        try:
            upstream = await anyio.connect_tcp(self._target_host, self._target_port)
        except OSError:
            connection.abort()  # the server is down: the client sees a reset
            return
        connection.upstream = upstream
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._forward, connection, _Flow(connection.client, upstream, True))
            tg.start_soon(self._forward, connection, _Flow(upstream, connection.client, False))

    async def _forward(self, connection: _Connection, flow: _Flow) -> None:
        send, receive = anyio.create_memory_object_stream[_Held](MAX_HELD_CHUNKS)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read, flow, send)
                await self._write(connection, flow, receive)
        finally:  # what the flow still holds is dropped with it
            self._held -= flow.held
            flow.held = 0

    async def _read(self, flow: _Flow, send: MemoryObjectSendStream[_Held]) -> None:
        with send:
            while True:
                data: bytes | _End
                try:
                    data = await flow.source.receive(CHUNK_SIZE)
                except anyio.EndOfStream:
                    data = _End.EOF
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    data = _End.RESET
                if isinstance(data, bytes):
                    flow.held += len(data)
                    self._held += len(data)
                    self._max_held = max(self._max_held, self._held)
                try:
                    await send.send((anyio.current_time() + self._latency, data))
                except anyio.BrokenResourceError:
                    return  # the writer gave up: the connection is over
                if isinstance(data, _End):
                    return

    async def _write(
        self, connection: _Connection, flow: _Flow, receive: MemoryObjectReceiveStream[_Held]
    ) -> None:
        with receive:
            async for due, data in receive:
                await anyio.sleep_until(due)
                await self._wait_flowing()
                if isinstance(data, bytes):
                    await self._deliver(connection, flow, data)
                elif data is _End.EOF:
                    await _send_eof(flow.sink)
                else:
                    connection.abort()

    async def _deliver(self, connection: _Connection, flow: _Flow, data: bytes) -> None:
        flow.held -= len(data)
        self._held -= len(data)
        # counted first: the peer may read the bytes before this task runs again
        if flow.to_target:
            self._to_target += len(data)
        else:
            self._to_client += len(data)
        try:
            await flow.sink.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            connection.abort()  # the sink is gone: reset the other side too

    async def _wait_flowing(self) -> None:
        """Wait while the proxy is blackholed."""
        while self._mode is ProxyMode.BLACKHOLE:
            await self._changed.wait()


async def _send_eof(sink: SocketStream) -> None:
    try:
        await sink.send_eof()
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass  # the sink is gone already; its own reader reports how


def _check_host(what: str, host: object) -> str:
    if not isinstance(host, str) or not host or host != host.strip():
        raise InvalidArgument(f"{what} must be a non-empty str without spaces, got {host!r}")
    return host.strip("[]")


def _check_port(what: str, port: object, *, lowest: int) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not lowest <= port <= 65535:
        raise InvalidArgument(f"{what} must be an int from {lowest} to 65535, got {port!r}")
    return port


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _linger_zero(stream: SocketStream) -> None:
    """Make closing ``stream`` send RST instead of FIN."""
    try:
        raw = stream.extra(SocketAttribute.raw_socket)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass  # already closed or reset: nothing left to reset


def _placeholder(family: socket.AddressFamily, address: tuple[Any, ...]) -> socket.socket | None:
    """Bind, without listening, ``address``: connects are refused but the port stays ours.

    Best effort (None if the port was taken meanwhile): the proxy's next listen may fail.
    """
    if sys.platform == "win32":  # SO_REUSEADDR would let the listener steal, not share
        return None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        return None
    return sock
