"""How the Redis backend's own commands reach the server: one interface, two transports.

The backend asks a :class:`Transport` for commands, batches of commands (pipelined in
one round trip), a batch written before returning, and pub/sub connections. Both
transports raise redis-py's exception types, which
:func:`~aiolease.backends.redis._errors.mapped_error` maps in one place.

* :class:`RedisPyTransport`: the redis-py client's own connections. Every mode works
  through it: TLS, RESP3, Cluster, Sentinel, ``wait_replicas``, a client passed in.
* :class:`LeanTransport`: one pipelined connection with hiredis's parser
  (:mod:`aiolease.backends.redis._resp`), and a lean pub/sub connection. redis-py's
  asyncio client spends about 100 µs of CPU per command in its own stack, more than
  a loopback round trip: over this transport an uncontended acquire+release takes
  about a third less time (``python benchmarks/bench_redis.py --only transports``).
  It serves a backend made from a ``redis://`` or ``unix://`` URL whose options it
  can honour (:func:`~aiolease.backends.redis._url.lean_endpoint`), without
  ``wait_replicas`` (``WAIT`` would hold up the one shared connection).

:func:`choose` picks one for ``RedisBackend.from_url``'s ``transport`` option:
``auto`` (the default: lean where it can serve, else redis-py), ``lean`` or
``redis-py``.

Asyncio-only, like the backend.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ResponseError

from ..._exceptions import InvalidArgument
from .._asyncio import guarded
from ._clients import Client, single_server
from ._pubsub import Dispatch, Wire
from ._scripts import Script, evaluate
from ._url import Endpoint, lean_endpoint

if TYPE_CHECKING:
    from ._resp import LeanClient, Subscriber

__all__ = ["TRANSPORTS", "LeanTransport", "RedisPyTransport", "Transport", "choose"]

#: The values of the ``transport`` option.
TRANSPORTS = ("auto", "lean", "redis-py")


class Transport(Protocol):
    """What the backend needs of a connection to the server.

    :ivar writes_now: :meth:`batch_now` can write before returning (else it never does)
    :ivar announces: a release is worth a leading ``PING`` (see
        :func:`aiolease.backends.redis._riders.send_with`): the transport spends less
        CPU on it than it saves a waiter in another process
    """

    writes_now: bool
    announces: bool

    async def call(self, *args: Any) -> Any:
        """One command; its reply.

        :raises redis.exceptions.RedisError: an error reply, a timeout, a lost connection
        """

    async def batch(self, commands: Sequence[Sequence[Any]], *, guard: bool) -> list[Any]:
        """Commands in one round trip; their replies, an error reply as its exception.

        :param guard: raise a cancellation that the driver let pass
            (see :func:`~aiolease.backends._asyncio.guarded`)
        :raises redis.exceptions.RedisError: the connection failed
        """

    def batch_now(self, commands: Sequence[Sequence[Any]]) -> Awaitable[list[Any]] | None:
        """:meth:`batch`, written before returning if the transport can
        (:attr:`writes_now`) and its connection is open; what awaits the replies,
        or ``None``: nothing was sent."""

    async def eval(self, script: Script, keys: Sequence[bytes], *args: Any) -> Any:
        """EVALSHA ``script``, loading it on NOSCRIPT.

        :raises redis.exceptions.RedisError: as :meth:`call`
        """

    async def subscriber(self) -> Wire:
        """A new, connected pub/sub connection.

        :raises redis.exceptions.RedisError: it could not connect
        """

    async def aclose(self) -> None:
        """Close what the transport opened itself (never the redis-py client). Idempotent."""


class RedisPyTransport:
    """Commands through a redis-py client (see the module docstring).

    :param client: a ``Redis`` (also a Sentinel's master) or a ``RedisCluster``
    """

    writes_now = False
    announces = False

    def __init__(self, client: Client) -> None:
        self._client = client

    async def call(self, *args: Any) -> Any:
        return await guarded(cast(Any, self._client).execute_command(*args))

    async def batch(self, commands: Sequence[Sequence[Any]], *, guard: bool) -> list[Any]:
        if len(commands) == 1:  # a pipeline costs redis-py more CPU than one command
            one = cast(Any, self._client).execute_command(*commands[0])
            try:
                return [await (guarded(one) if guard else one)]
            except ResponseError as exc:
                return [exc]
        pipe = self._client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        sent = pipe.execute(raise_on_error=False)
        return cast(list[Any], await (guarded(sent) if guard else sent))

    def batch_now(self, commands: Sequence[Sequence[Any]]) -> Awaitable[list[Any]] | None:
        return None

    async def eval(self, script: Script, keys: Sequence[bytes], *args: Any) -> Any:
        return await evaluate(self.call, script, keys, *args)

    async def subscriber(self) -> Wire:
        client = self._client
        if isinstance(client, RedisCluster):
            # Plain pub/sub messages reach every node of a Cluster: any node will do.
            node = client.get_random_node()
            node_conn = node.acquire_connection()

            async def give_back() -> None:
                try:
                    await node_conn.disconnect(nowait=True)
                finally:
                    node.release(node_conn)

            try:
                await cast(Any, node_conn).connect()
            except BaseException:
                await asyncio.shield(give_back())
                raise
            return _RedisPyWire(node_conn, give_back)
        pool = client.connection_pool
        conn: AbstractConnection = await cast(Any, pool).get_connection()

        async def release() -> None:
            try:
                await conn.disconnect(nowait=True)
            finally:
                await pool.release(conn)

        return _RedisPyWire(conn, release)

    async def aclose(self) -> None:
        pass  # the client is the backend's to close, if it made it


class _RedisPyWire:
    """A pub/sub connection of redis-py's pool."""

    def __init__(self, conn: AbstractConnection, release: Callable[[], Awaitable[None]]) -> None:
        self._conn = conn
        self._release = release

    @property
    def alive(self) -> bool:
        return bool(self._conn.is_connected)

    async def write(self, commands: Sequence[tuple[Any, ...]]) -> None:
        conn = self._conn
        await conn.send_packed_command(conn.pack_commands(commands), check_health=False)

    async def listen(self, dispatch: Dispatch) -> None:
        while True:
            reply = await self._conn.read_response(
                timeout=math.inf, disconnect_on_error=False, push_request=True
            )
            dispatch(reply)

    async def release(self) -> None:
        await self._release()


class LeanTransport:
    """Commands over one lean, pipelined connection (see the module docstring).

    :param endpoint: where to connect, and the timeouts
    """

    writes_now = True
    announces = True

    def __init__(self, endpoint: Endpoint) -> None:
        from ._resp import LeanClient  # hiredis, only when a lean transport is made

        self._lean: LeanClient = LeanClient(endpoint)

    async def call(self, *args: Any) -> Any:
        # "SCRIPT LOAD" and "CONFIG GET" are one name to redis-py, two words on the wire.
        return await self._lean.execute(*args[0].split(), *args[1:])

    async def batch(self, commands: Sequence[Sequence[Any]], *, guard: bool) -> list[Any]:
        # guard: a lean command's cancellation is never lost (see _resp).
        return await self._lean.execute_many(commands)

    def batch_now(self, commands: Sequence[Sequence[Any]]) -> Awaitable[list[Any]] | None:
        sent = self._lean.send_now(commands)
        return None if sent is None else self._lean.replies(sent)

    async def eval(self, script: Script, keys: Sequence[bytes], *args: Any) -> Any:
        return await evaluate(self.call, script, keys, *args)

    async def subscriber(self) -> Wire:
        return _LeanWire(await self._lean.subscriber())

    async def aclose(self) -> None:
        await self._lean.aclose()


class _LeanWire:
    """A lean pub/sub connection: hiredis parses, and replies are dispatched from the
    protocol's callback (a tenth of redis-py's CPU per message)."""

    def __init__(self, subscriber: Subscriber) -> None:
        self._subscriber = subscriber

    @property
    def alive(self) -> bool:
        return self._subscriber.alive

    async def write(self, commands: Sequence[tuple[Any, ...]]) -> None:
        self._subscriber.write(commands)

    async def listen(self, dispatch: Dispatch) -> None:
        await self._subscriber.listen(dispatch)

    async def release(self) -> None:
        self._subscriber.close()


def choose(choice: object, client: Client, url: str, timeout: float, *, replicas: int) -> Transport:
    """The transport that ``choice`` (``transport=``) asks for, for a backend that made
    ``client`` from ``url`` (as redis-py takes it).

    :param timeout: seconds a command and a connect take, unless the URL says
    :param replicas: the backend's ``wait_replicas``
    :raises InvalidArgument: an unknown choice, or ``lean`` where it cannot serve
    """
    if choice not in TRANSPORTS:
        raise InvalidArgument(
            f"Redis option transport must be one of {', '.join(TRANSPORTS)}, got {choice!r}"
        )
    endpoint = None
    if choice != "redis-py" and not replicas and single_server(client):
        endpoint = lean_endpoint(url, timeout)
    if endpoint is not None and importlib.util.find_spec("hiredis") is not None:
        return LeanTransport(endpoint)
    if choice == "lean":
        raise InvalidArgument(
            "transport=lean serves a redis:// or unix:// URL with no option but db,"
            " client_name, socket_timeout, socket_connect_timeout and max_connections,"
            " without wait_replicas, and needs hiredis; use transport=auto or redis-py"
        )
    return RedisPyTransport(client)
