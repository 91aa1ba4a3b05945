"""Serve any backend over TCP, so that in-process backends reach across OS processes.

The memory backend lives in one process. To let several worker processes contend
for one name on it (the safety tests), host it in a server process and point the
workers at it::

    python -m aiolease.testing.remote --url memory:// --port 7411
    # -> listening on 127.0.0.1:7411

    async with aiolease.open_backend("remote://127.0.0.1:7411") as backend: ...

A fault proxy may sit between a worker and the server, and the server may be
killed and restarted (a restarted memory backend starts its tokens again at 1:
it has no :attr:`~aiolease.abc.Capability.DURABLE_TOKENS`).

The protocol is one JSON object per line. A request is
``{"id": ID, "op": OP, "args": {...}}``; its reply is ``{"id": ID, "ok": VALUE}``
or ``{"id": ID, "error": {"type": T, "message": M, "name": N}}``. A connection
carries one request at a time. ``OP`` is ``hello`` (capabilities and poll
interval) or one of the :class:`~aiolease.abc.Backend` operations. Errors of the
contract (:class:`NotOwnerError`, :class:`InvalidArgument`, :class:`BackendError`
and its subclasses) are re-raised by type on the client; anything else becomes
:class:`BackendError`. The server cancels a call whose client hangs up, so a
client cancels a call (a long ``wait_changed``, say) by closing its connection.

**Request ids.** The client numbers its requests (unique per
:class:`RemoteBackend`) and the server echoes the number in the reply. A reply
that does not carry the id of the request just sent, or is not of the shape its
operation answers with, is a :class:`BackendError` and closes the connection:
it is never taken as the answer. The pool already never reuses a connection
whose call did not complete (timed out, cancelled, failed), so a reply held back
by the network cannot reach a later call; the ids make sure that, should it
ever happen anyway, a stale grant cannot pass for the answer to a new
``try_acquire``.

**Send times.** A session backend may report in :attr:`Grant.sent_at` that the
confirming request left *before* the call (see :mod:`aiolease.abc`). That time is
on the server process's clock, which the client cannot read (trio's clock has a
per-run offset, and other hosts have other clocks). So the server sends only how
long before it received the request that was, and the client subtracts it from
its own send time: never later than the truth, whichever clocks are involved.
"""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import logging
import signal
import sys
from collections.abc import Callable, Mapping
from contextlib import suppress
from typing import Any, NoReturn, TypeVar
from urllib.parse import parse_qsl

import anyio
from anyio.abc import SocketStream, TaskStatus
from anyio.streams.buffered import BufferedByteReceiveStream

from .._bridge import adapt
from .._exceptions import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    InvalidArgument,
)
from .._registry import open_backend
from .._urls import redact, scrub, split_url
from ..abc import Backend, Capability, ForwardingBackend, Grant
from ._remote_wire import (
    _DECODERS,
    _IO_ERRORS,
    MAX_FRAME,
    PROTOCOL,
    _decode_error,
    _decode_hello,
    _decode_holder,
    _decode_renewals,
    _encode_args,
    _encode_error,
    _encode_grant,
    _encode_holder,
    _encode_results,
    _field,
    _frame,
    _metadata,
    _parse,
    _ProtocolError,
    _reply_to,
    _seconds,
    encode_permits,
)

__all__ = ["PROTOCOL", "BackendServer", "RemoteBackend", "main"]

logger = logging.getLogger("aiolease.testing.remote")
T = TypeVar("T")

# -- the server -------------------------------------------------------------------------


class BackendServer:
    """Serves ``backend`` to :class:`RemoteBackend` clients over TCP.

    Each connection is served by its own task, one request at a time. The server
    never closes ``backend``.

    :param backend: the backend that really stores the leases
    :param host: the address to listen on
    :param port: the port to listen on (``0``: any free port)
    """

    def __init__(self, backend: Backend, host: str = "127.0.0.1", port: int = 0) -> None:
        self.backend = backend
        self.host = host
        self.port = port

    def __repr__(self) -> str:
        return f"<BackendServer {_hostport(self.host, self.port)} serving {self.backend!r}>"

    async def serve(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> NoReturn:
        """Listen and serve until cancelled; report the bound port with ``task_status``.

        Cancelling this closes every connection, as a crash of the server would.
        """
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        async with listener:
            self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
            task_status.started(self.port)
            await listener.serve(self._serve_connection)
        raise AssertionError("unreachable: a listener serves until cancelled")  # pragma: no cover

    async def _serve_connection(self, stream: SocketStream) -> None:
        async with stream:
            reader = BufferedByteReceiveStream(stream)
            try:
                while True:
                    line = await reader.receive_until(b"\n", MAX_FRAME)
                    reply = await self._answer_while_connected(line, reader)
                    if reply is None:
                        return
                    await stream.send(reply)
            except (*_IO_ERRORS, anyio.DelimiterNotFound):
                return  # the client went away, or broke the framing: drop it
            except Exception:
                logger.exception("remote backend connection failed")

    async def _answer_while_connected(
        self, line: bytes, reader: BufferedByteReceiveStream
    ) -> bytes | None:
        """Answer ``line``, or cancel the call and return ``None`` if the client hangs up.

        The client sends nothing more until it has the reply, so anything it sends
        meanwhile (end of stream included) means it gave up.
        """
        replies: list[bytes] = []

        async def watch_hangup() -> None:
            with suppress(Exception):  # any end or error of the stream is a hang-up too
                await reader.receive()
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_hangup)
            replies.append(await self._answer(line))
            tg.cancel_scope.cancel()
        return replies[0] if replies else None

    async def _answer(self, line: bytes) -> bytes:
        """The reply to the request ``line``, carrying its id (``null`` if it has none)."""
        received = anyio.current_time()
        request_id: int | None = None
        try:
            request = _parse(line)
            request_id = _field(request, "id", int, optional=True)
            value = await self._call(
                _field(request, "op", str), request.get("args") or {}, received
            )
        except _ProtocolError as exc:
            error = _encode_error(InvalidArgument(f"bad request: {exc}"))
            return _frame({"id": request_id, "error": error})
        except Exception as exc:
            return _frame({"id": request_id, "error": _encode_error(exc)})
        return _frame({"id": request_id, "ok": value})

    async def _call(self, op: str, args: object, received: float) -> Any:
        backend = adapt(self.backend)
        if op == "hello":
            capabilities = sorted(c.value for c in backend.capabilities)
            interval = backend.poll_interval
            return {
                "protocol": PROTOCOL,
                "capabilities": capabilities,
                "poll_interval": interval,
                "renews_many": backend.renews_many,
            }
        if op == "renew_many":
            results = await backend.renew_many(_decode_renewals(args))
            return _encode_results(results, received)
        name = _field(args, "name", str)
        if op == "try_acquire":
            ttl = _seconds(args, "ttl")
            owner, identity = _field(args, "owner", str), _field(args, "identity", str)
            result = await backend.try_acquire(name, owner, ttl, identity, _metadata(args))
            if isinstance(result, Grant):
                return {"grant": _encode_grant(result, received)}
            return {"holder": _encode_holder(result)}
        if op == "try_acquire_permit":
            ttl = _seconds(args, "ttl")
            owner, identity = _field(args, "owner", str), _field(args, "identity", str)
            limit, weight = _field(args, "limit", int), _field(args, "weight", int)
            result = await backend.try_acquire_permit(
                name, owner, ttl, identity, _metadata(args), limit, weight
            )
            if isinstance(result, Grant):
                return {"grant": _encode_grant(result, received)}
            return {"holder": _encode_holder(result)}
        if op == "read_permits":
            return encode_permits(await backend.read_permits(name))
        if op == "wait_permit_turn":
            owner, ttl = _field(args, "owner", str), _seconds(args, "ttl")
            seen = args.get("seen") if isinstance(args, dict) else None
            await backend.wait_permit_turn(name, owner, ttl, _decode_holder(seen))
            return None
        if op == "renew":
            ttl = _seconds(args, "ttl")
            owner, token = _field(args, "owner", str), _field(args, "token", int)
            return _encode_grant(await backend.renew(name, owner, token, ttl), received)
        if op == "release":
            owner, token = _field(args, "owner", str), _field(args, "token", int, optional=True)
            return await backend.release(name, owner, token)
        if op == "read":
            holder = await backend.read(name)
            return None if holder is None else _encode_holder(holder)
        if op == "wait_changed":
            seen = args.get("seen") if isinstance(args, dict) else None
            await backend.wait_changed(name, None if seen is None else _decode_holder(seen))
            return None
        if op == "wait_taken":
            await backend.wait_taken(name, _decode_holder(_field(args, "held", dict)))
            return None
        if op == "wait_turn":
            owner, ttl = _field(args, "owner", str), _seconds(args, "ttl")
            seen = args.get("seen") if isinstance(args, dict) else None
            await backend.wait_turn(name, owner, ttl, _decode_holder(seen))
            return None
        if op == "wait_lost":
            owner, token = _field(args, "owner", str), _field(args, "token", int)
            reason = await backend.wait_lost(name, owner, token)
            return reason.value
        if op == "update_metadata":
            owner, token = _field(args, "owner", str), _field(args, "token", int)
            await backend.update_metadata(name, owner, token, _metadata(args))
            return None
        raise _ProtocolError(f"unknown operation {op!r}")


# -- the client -------------------------------------------------------------------------


class _Connection:
    """One TCP connection to the server; one request at a time."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)

    async def request(self, frame: bytes) -> bytes:
        await self.stream.send(frame)
        return await self.reader.receive_until(b"\n", MAX_FRAME)

    @property
    def clean(self) -> bool:
        """Whether nothing is left unread (only then may it be reused)."""
        return not self.reader.buffer

    async def close(self) -> None:
        """Close at once, even in a cancelled scope (a reset tells the server to stop)."""
        await anyio.aclose_forcefully(self.stream)


class RemoteBackend(ForwardingBackend):
    """A backend served by a :class:`BackendServer` in another process (or this one).

    Open it with ``open_backend("remote://HOST:PORT")``. Its capabilities are the
    served backend's, learned at connection, plus
    :attr:`~aiolease.abc.Capability.MULTI_PROCESS`; so are its poll interval and
    :attr:`~aiolease.abc.Backend.renews_many`.

    A :class:`~aiolease.abc.ForwardingBackend`: every awaited operation of the
    contract travels to the server (:meth:`_forward`). The plain synchronous hooks
    (:meth:`~aiolease.abc.Backend.release_now`, :meth:`~aiolease.abc.Backend.hold`,
    :meth:`~aiolease.abc.Backend.on_taken`) cannot cross the wire and answer
    ``None``: the core then releases with ``release``, renews a session backend's
    leases itself and watches them with ``wait_lost``, and watches takeovers with
    ``wait_taken``, all of which travel.

    Every call takes a connection from a small pool of idle ones (or opens one), so
    concurrent calls run concurrently. A call that fails, times out or is cancelled
    closes its connection, which also cancels it on the server; no connection with
    a reply left unread goes back to the pool. A reply must carry the id of its
    request and be of the shape its operation answers with; any other is a
    :class:`BackendError` and closes the connection. Nothing is retried: refused,
    reset or closed connections raise :class:`BackendUnavailable` (and drop the
    idle connections, which are likely stale too) and the next call reconnects.

    The compensating release after a cancelled acquire travels on another
    connection. Should the network hold the cancelled request back until after
    that release (the server has not read it before the hang-up), the grant it
    makes belongs to no one and lapses after its ttl: a delay, never two holders.

    :param host: the server's address
    :param port: the server's port
    :param connect_timeout: seconds to wait for a connection
    :param request_timeout: seconds to wait for any reply but ``wait_changed``'s
        (``None``: no limit); past it the outcome is unknown (:class:`BackendTimeout`)
    :param max_idle: how many idle connections to keep
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout: float = 5.0,
        request_timeout: float | None = 30.0,
        max_idle: int = 4,
    ) -> None:
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._closed = False
        self._ids = itertools.count(1)
        self._served: frozenset[Capability] = frozenset()
        self._renews_many = False

    def __repr__(self) -> str:
        return f"<RemoteBackend remote://{_hostport(self.host, self.port)}>"

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> RemoteBackend:
        """``remote://HOST:PORT``, with options as keywords or in the query string
        (``?request_timeout=5&max_idle=2``); then ask the server what it serves.

        :raises InvalidArgument: the URL or an option is malformed
        :raises BackendUnavailable: the server cannot be reached
        :raises BackendError: it does not speak this protocol
        """
        host, port, query = _parse_url(url)
        backend = cls(host, port, **_options({**query, **options}))
        try:
            await backend.hello()
        except BaseException:
            await backend.aclose()
            raise
        return backend

    async def hello(self) -> None:
        """Learn the served backend's capabilities and poll interval.

        :raises BackendError: the server speaks another protocol
        """
        try:
            hello = await self._call("hello", {}, self.request_timeout, _decode_hello)
        except BackendError as exc:
            if type(exc) is not BackendError:  # unreachable, or no reply in time
                raise
            raise BackendError(f"{self!r} is not an aiolease backend server: {exc}") from exc
        served, interval, renews_many = hello
        self._served = served
        self.poll_interval = interval
        self._renews_many = renews_many

    @property
    def capabilities(self) -> frozenset[Capability]:
        """The served backend's (once :meth:`hello` learned them) and
        :attr:`~aiolease.abc.Capability.MULTI_PROCESS`."""
        return self._served | {Capability.MULTI_PROCESS}

    @property
    def renews_many(self) -> bool:
        """The served backend's (once :meth:`hello` learned it)."""
        return self._renews_many

    async def _forward(self, op: str, *args: Any) -> Any:
        """Send the operation ``op`` with ``args`` to the server, and decode its reply.

        :raises BackendTimeout: no reply within :attr:`request_timeout` (the waits,
            ``wait_*``, have no limit)
        """
        sent_at = anyio.current_time()
        timeout = None if op.startswith("wait_") else self.request_timeout
        decode = _DECODERS[op]
        return await self._call(op, _encode_args(op, args), timeout, lambda v: decode(v, sent_at))

    async def aclose(self) -> None:
        """Close every connection; calls in flight fail with :class:`BackendUnavailable`."""
        self._closed = True
        connections, self._open, self._idle = self._open, set(), []
        for connection in connections:
            await connection.close()

    async def _connect(self) -> _Connection:
        try:
            with anyio.fail_after(self.connect_timeout):
                stream = await anyio.connect_tcp(self.host, self.port)
        except (OSError, TimeoutError) as exc:
            raise BackendUnavailable(f"cannot connect to {self!r}: {exc!r}") from exc
        connection = _Connection(stream)
        if self._closed:  # aclose() ran while this connected
            await connection.close()
            raise BackendUnavailable(f"{self!r} is closed")
        self._open.add(connection)
        return connection

    async def _checkout(self) -> _Connection:
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        if self._idle:
            return self._idle.pop()
        return await self._connect()

    async def _checkin(self, connection: _Connection) -> None:
        if self._closed or len(self._idle) >= self.max_idle:
            await self._drop(connection)
        else:
            self._idle.append(connection)

    async def _drop(self, connection: _Connection) -> None:
        self._open.discard(connection)
        await connection.close()

    async def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            await self._drop(connection)

    async def _call(
        self,
        op: str,
        args: Mapping[str, Any],
        timeout: float | None,
        decode: Callable[[Any], T],
    ) -> T:
        """Send one request on a pooled connection; return its reply's value, decoded.

        Only a connection whose reply came whole, answered this very request and
        decoded goes back to the pool; any other is closed (which also cancels the
        call on the server).

        :param decode: makes the value of an ``ok`` reply into the result; raises
            :class:`_ProtocolError` if it is not what ``op`` answers with
        :raises BackendUnavailable: the connection failed (refused, reset, closed)
        :raises BackendTimeout: no reply within ``timeout``; the outcome is unknown
        :raises BackendError: the reply is malformed, or answers another request
        """
        request_id = next(self._ids)
        frame = _frame({"id": request_id, "op": op, "args": args})
        connection = await self._checkout()
        try:
            with anyio.fail_after(timeout):
                line = await connection.request(frame)
            if not connection.clean:
                raise _ProtocolError(f"more than one reply to request {request_id}")
            reply = _reply_to(request_id, line)
            outcome = _decode_error(reply["error"]) if "error" in reply else decode(reply["ok"])
        except BaseException as exc:
            # Cancelled or failed: the reply may still come, so this connection is done.
            await self._drop(connection)
            if isinstance(exc, _IO_ERRORS):
                await self._drop_idle()  # the server is likely gone: they are stale too
            mapped = self._mapped(op, exc, timeout)
            if mapped is exc:
                raise
            raise mapped from exc
        await self._checkin(connection)
        if isinstance(outcome, Exception):  # an error of the contract, reported by the server
            raise outcome
        return outcome

    def _mapped(self, op: str, exc: BaseException, timeout: float | None) -> BaseException:
        """The exception to raise for ``exc`` (``exc`` itself if not the connection's)."""
        if isinstance(exc, TimeoutError):
            return BackendTimeout(f"{op} on {self!r}: no reply within {timeout}s")
        if isinstance(exc, _IO_ERRORS):
            return BackendUnavailable(f"{op} on {self!r} failed: {exc!r}")
        if isinstance(exc, (_ProtocolError, anyio.DelimiterNotFound)):
            return BackendError(f"{op} on {self!r}: bad reply, connection closed: {exc}")
        return exc


# -- URLs and options ----------------------------------------------------------------------

_OPTIONS: dict[str, type] = {"connect_timeout": float, "request_timeout": float, "max_idle": int}


def _hostport(host: str, port: int) -> str:
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_v6 = False
    return f"[{host}]:{port}" if is_v6 else f"{host}:{port}"


def _parse_url(url: str) -> tuple[str, int, dict[str, str]]:
    """:raises InvalidArgument: unless ``url`` is ``remote://HOST:PORT[?options]``"""
    parts = split_url(url, "remote backend")
    usage = f"a remote backend URL is 'remote://HOST:PORT', got {redact(url)!r}"
    try:
        port = parts.port
    except ValueError as exc:
        raise InvalidArgument(scrub(f"{usage}: {exc}", url)) from None
    if parts.scheme != "remote" or not parts.hostname or parts.username or parts.password:
        raise InvalidArgument(usage)
    if port is None or port == 0 or parts.path not in ("", "/") or parts.fragment:
        raise InvalidArgument(usage)
    try:
        # Python 3.10's strict parse rejects an empty query; 3.11+ returns no pairs.
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
        query = dict(pairs)
    except ValueError:
        raise InvalidArgument(f"{usage}: bad query {parts.query!r}") from None
    return parts.hostname, port, query


def _options(given: Mapping[str, Any]) -> dict[str, Any]:
    """Check and convert the options (query strings arrive as text).

    :raises InvalidArgument: an unknown option, or a value out of range
    """
    out: dict[str, Any] = {}
    for key, value in given.items():
        kind = _OPTIONS.get(key)
        if kind is None:
            raise InvalidArgument(
                f"unknown remote backend option {key!r}; known: {sorted(_OPTIONS)}"
            )
        if key == "request_timeout" and value in (None, "none", "None"):
            out[key] = None
            continue
        try:
            number = kind(value)
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"remote backend option {key}={value!r} is not a number"
            ) from None
        fractional = kind is int and isinstance(value, float)
        if isinstance(value, bool) or fractional or not number >= (0 if kind is int else 1e-9):
            raise InvalidArgument(f"remote backend option {key}={value!r} is out of range")
        out[key] = number
    return out


# -- python -m aiolease.testing.remote --------------------------------------------------------


async def _serve_url(url: str, host: str, port: int) -> None:
    """Open the backend ``url`` names and serve it until SIGTERM or SIGINT."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with open_backend(url) as backend, anyio.create_task_group() as tg:
            bound = await tg.start(BackendServer(backend, host, port).serve)
            print(f"listening on {_hostport(host, bound)}", flush=True)
            async for _ in signals:
                break
            tg.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> None:
    """``python -m aiolease.testing.remote --url URL [--host H] [--port P] [--loop L]``."""
    parser = argparse.ArgumentParser(
        prog="python -m aiolease.testing.remote",
        description="Serve an aiolease backend over TCP to remote:// clients.",
    )
    parser.add_argument("--url", required=True, help="the backend to serve, e.g. memory://")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any)")
    parser.add_argument("--loop", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="remote: %(levelname)s %(message)s")
    anyio.run(_serve_url, args.url, args.host, args.port, backend=args.loop)


if __name__ == "__main__":
    main(sys.argv[1:])
