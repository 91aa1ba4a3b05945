"""FaultProxy against a real Redis: every mode, switched at run time, per proxy.

The tests speak RESP over plain anyio sockets through the proxy, so that what
they see is exactly what the proxy forwards; one test drives redis.asyncio.
Time is only ever bounded from below (a delay took at least its latency);
"nothing arrives" is checked over a short window, and then the same bytes are
shown to arrive once the fault is healed.
"""

from __future__ import annotations

import random
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

import anyio
import anyio.lowlevel
import pytest
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from aiolease import InvalidArgument
from aiolease.testing.proxy import CHUNK_SIZE, FaultProxy, ProxyMode, main

pytestmark = pytest.mark.anyio

GetServer = Callable[[str], str]

#: How long "nothing arrives" is watched: long enough for loopback, short for the suite.
QUIET = 0.3
LATENCY = 0.25
PONG = b"+PONG\r\n"


def resp(*args: str | bytes) -> bytes:
    """One command in RESP (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else arg
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class Client:
    """A raw RESP connection: send commands, read replies."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)

    async def send(self, *args: str | bytes) -> None:
        await self.stream.send(resp(*args))

    async def line(self) -> bytes:
        """One reply line, with its CRLF."""
        return await self.reader.receive_until(b"\r\n", 1 << 20) + b"\r\n"

    async def bulk(self) -> bytes | None:
        """One bulk-string reply."""
        header = await self.line()
        assert header.startswith(b"$"), header
        size = int(header[1:-2])
        if size < 0:
            return None
        data = await self.reader.receive_exactly(size + 2)
        return data[:-2]

    async def call(self, *args: str | bytes) -> bytes:
        await self.send(*args)
        return await self.line()

    async def nothing_within(self, seconds: float = QUIET) -> bool:
        """True if no reply byte arrives within ``seconds``."""
        with anyio.move_on_after(seconds) as scope:
            await self.reader.receive(1)
            return False
        return scope.cancelled_caught

    async def eof(self) -> None:
        """Expect the end of the stream (an orderly FIN) after the replies read so far.

        :raises anyio.EndOfStream: as expected
        """
        await self.reader.receive()

    async def aclose(self) -> None:
        await self.stream.aclose()


@pytest.fixture
def redis_address(aiolease_server: GetServer) -> tuple[str, int]:
    parts = urlsplit(aiolease_server("redis"))
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


@pytest.fixture
async def proxy(redis_address: tuple[str, int]) -> AsyncIterator[FaultProxy]:
    async with FaultProxy(*redis_address) as proxy:
        yield proxy


class Dialer:
    """Opens clients, and closes them all when the test ends."""

    def __init__(self) -> None:
        self.clients: list[Client] = []

    async def to(self, host: str, port: int) -> Client:
        client = Client(await anyio.connect_tcp(host, port))
        self.clients.append(client)
        return client

    async def via(self, proxy: FaultProxy) -> Client:
        return await self.to(proxy.host, proxy.port)


@pytest.fixture
async def dial() -> AsyncIterator[Dialer]:
    dialer = Dialer()
    yield dialer
    for client in dialer.clients:
        await client.aclose()


def key() -> str:
    return f"aiolease-test:proxy:{uuid.uuid4().hex}"


def refused(exc: BaseException) -> bool:
    """True if ``exc`` (anyio wraps it) is a refused connect."""
    return isinstance(exc, ConnectionRefusedError) or isinstance(
        exc.__cause__, ConnectionRefusedError
    )


async def test_pass_forwards_both_ways(
    proxy: FaultProxy, redis_address: tuple[str, int], dial: Dialer
) -> None:
    name = key()
    client = await dial.via(proxy)
    assert await client.call("PING") == PONG
    assert await client.call("SET", name, "v", "PX", "60000") == b"+OK\r\n"
    direct = await dial.to(*redis_address)
    await direct.send("GET", name)
    assert await direct.bulk() == b"v"
    stats = proxy.statistics()
    assert (stats.mode, stats.connections, stats.accepted) == (ProxyMode.PASS, 1, 1)
    assert stats.bytes_to_target == len(resp("PING")) + len(resp("SET", name, "v", "PX", "60000"))
    assert stats.bytes_to_client == len(PONG) + len(b"+OK\r\n")


async def test_delay_delays_each_direction(proxy: FaultProxy, dial: Dialer) -> None:
    client = await dial.via(proxy)
    assert await client.call("PING") == PONG
    await proxy.delay(LATENCY)
    assert (proxy.mode, proxy.latency) == (ProxyMode.DELAY, LATENCY)
    start = anyio.current_time()
    assert await client.call("PING") == PONG
    # the request waited LATENCY on its way in, the reply LATENCY on its way out
    assert anyio.current_time() - start >= 2 * LATENCY * 0.99
    await proxy.pass_through()
    assert proxy.latency == 0


async def test_delay_pipelines_chunks(proxy: FaultProxy, dial: Dialer) -> None:
    name, value = key(), uuid.uuid4().bytes * (1 << 18)  # 4 MiB: 64 chunks or more
    latency = 0.4
    client = await dial.via(proxy)
    await proxy.delay(latency)
    start = anyio.current_time()
    assert await client.call("SET", name, value, "PX", "60000") == b"+OK\r\n"
    await client.send("GET", name)
    assert await client.bulk() == value
    assert anyio.current_time() - start >= 4 * latency * 0.99
    # Many chunks were on the wire at once. A proxy that waited out the latency per
    # chunk would hold two at most: one waiting, and the next one read.
    assert proxy.statistics().max_held_bytes >= 4 * CHUNK_SIZE
    assert proxy.statistics().held_bytes == 0


async def test_blackhole_holds_everything_until_pass(
    proxy: FaultProxy, redis_address: tuple[str, int], dial: Dialer
) -> None:
    name, channel = key(), key()
    subscriber, writer = await dial.via(proxy), await dial.via(proxy)
    await subscriber.send("SUBSCRIBE", channel)
    # ["subscribe", channel, 1]: the server has subscribed it
    assert [await subscriber.line() for _ in range(6)][-1] == b":1\r\n"
    direct = await dial.to(*redis_address)

    await proxy.blackhole()
    # server -> client is held: the server delivers a message the subscriber never sees
    assert await direct.call("PUBLISH", channel, "hello") == b":1\r\n"
    # client -> server is held: the SET never reaches the server
    await writer.send("SET", name, "v", "PX", "60000")
    # a new connection is accepted, and blackholed too
    late = await dial.via(proxy)
    await late.send("PING")
    assert await writer.nothing_within()
    assert await subscriber.nothing_within(0)
    assert await late.nothing_within(0)
    await direct.send("GET", name)
    assert await direct.bulk() is None

    await proxy.pass_through()
    assert await writer.line() == b"+OK\r\n"
    assert await late.line() == PONG
    assert proxy.statistics().accepted == 3
    assert await subscriber.line() == b"*3\r\n"
    assert [await subscriber.line() for _ in range(6)][-1] == b"hello\r\n"
    await direct.send("GET", name)
    assert await direct.bulk() == b"v"


async def test_reset_drops_what_a_blackhole_held(proxy: FaultProxy, dial: Dialer) -> None:
    client = await dial.via(proxy)
    assert await client.call("PING") == PONG
    await proxy.blackhole()
    await client.send("PING")
    assert await client.nothing_within()
    await proxy.reset()
    with pytest.raises(anyio.BrokenResourceError):
        await client.line()
    assert proxy.statistics().held_bytes == 0


async def test_reset_resets_open_and_new_connections(proxy: FaultProxy, dial: Dialer) -> None:
    first = await dial.via(proxy)
    assert await first.call("PING") == PONG
    await proxy.reset()
    assert proxy.statistics().connections == 0
    with pytest.raises(anyio.BrokenResourceError):  # ECONNRESET, not an orderly EOF
        await first.line()
    second = await dial.via(proxy)
    with pytest.raises(anyio.BrokenResourceError):
        await second.line()
    assert proxy.statistics().accepted == 2

    await proxy.pass_through()
    third = await dial.via(proxy)
    assert await third.call("PING") == PONG


async def test_refuse_stops_listening_but_keeps_open_connections(
    proxy: FaultProxy, dial: Dialer
) -> None:
    port = proxy.port
    client = await dial.via(proxy)
    assert await client.call("PING") == PONG
    await proxy.refuse()
    with pytest.raises(OSError) as info:
        await dial.via(proxy)
    assert refused(info.value)
    assert await client.call("PING") == PONG  # untouched

    await proxy.pass_through()
    assert proxy.port == port
    again = await dial.via(proxy)
    assert await again.call("PING") == PONG
    assert proxy.statistics().accepted == 2


async def test_leaving_refuse_for_blackhole_or_reset_listens_again(
    proxy: FaultProxy, dial: Dialer
) -> None:
    await proxy.refuse()
    await proxy.blackhole()
    held = await dial.via(proxy)
    await held.send("PING")
    assert await held.nothing_within()
    await proxy.pass_through()
    assert await held.line() == PONG

    await proxy.refuse()
    await proxy.reset()
    new = await dial.via(proxy)
    for client in (held, new):
        with pytest.raises(anyio.BrokenResourceError):
            await client.line()


async def test_modes_are_per_proxy(redis_address: tuple[str, int], dial: Dialer) -> None:
    async with FaultProxy(*redis_address) as cut, FaultProxy(*redis_address) as other:
        cut_client, other_client = await dial.via(cut), await dial.via(other)
        await cut.blackhole()
        await cut_client.send("PING")
        assert await other_client.call("PING") == PONG
        assert await cut_client.nothing_within()
        await other.reset()
        await cut.pass_through()
        assert await cut_client.line() == PONG
        with pytest.raises(anyio.BrokenResourceError):
            await other_client.line()


async def test_half_close_travels_as_a_half_close(proxy: FaultProxy, dial: Dialer) -> None:
    client = await dial.via(proxy)
    assert await client.call("PING") == PONG
    await client.stream.send_eof()  # Redis answers an EOF by closing: an orderly FIN back
    with pytest.raises(anyio.EndOfStream):
        await client.eof()


async def test_a_server_that_is_down_resets_the_client(dial: Dialer) -> None:
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))  # bound, not listening: connects are refused
        port = placeholder.getsockname()[1]
        async with FaultProxy("127.0.0.1", port) as proxy:
            client = await dial.via(proxy)
            with pytest.raises(anyio.BrokenResourceError):
                await client.line()


async def test_exit_closes_connections_and_the_port(
    redis_address: tuple[str, int], dial: Dialer
) -> None:
    async with FaultProxy(*redis_address) as proxy:
        client = await dial.via(proxy)
        assert await client.call("PING") == PONG
    with pytest.raises(anyio.EndOfStream):
        await client.eof()
    with pytest.raises(OSError) as info:
        await dial.via(proxy)
    assert refused(info.value)
    with pytest.raises(RuntimeError):
        await proxy.pass_through()


async def test_a_busy_port_fails_on_entry(redis_address: tuple[str, int]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):  # bare, not wrapped in an exception group
            async with FaultProxy(*redis_address, port=taken.getsockname()[1]):
                pytest.fail("entered a proxy that could not listen")


@pytest.mark.parametrize("url", ["redis://:s3cret@h1:1,h2:2/0", "redis://:s3cret@/0"])
async def test_a_bad_url_for_the_proxy_never_shows_its_password(
    proxy: FaultProxy, url: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        proxy.url_for(url)
    assert "s3cret" not in str(caught.value)


async def test_arguments_are_validated(proxy: FaultProxy) -> None:
    for bad in (-1.0, float("nan"), float("inf"), "0.1"):
        with pytest.raises(InvalidArgument):
            await proxy.delay(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        await proxy.set_mode("warp")
    with pytest.raises(InvalidArgument):
        await proxy.set_mode(ProxyMode.BLACKHOLE, 0.5)
    await proxy.set_mode("delay", 0.0)
    assert proxy.mode is ProxyMode.DELAY


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("127.0.0.1", 0), {}),
        (("127.0.0.1", 65536), {}),
        (("127.0.0.1", True), {}),
        (("127.0.0.1", "6379"), {}),
        (("", 6379), {}),
        ((None, 6379), {}),
        (("127.0.0.1", 6379), {"port": -1}),
        (("127.0.0.1", 6379), {"host": ""}),
    ],
)
def test_constructor_rejects_bad_addresses(
    args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    with pytest.raises(InvalidArgument):
        FaultProxy(*args, **kwargs)  # type: ignore[arg-type]


def test_port_is_unknown_before_start() -> None:
    with pytest.raises(RuntimeError):
        FaultProxy("127.0.0.1", 6379).port  # noqa: B018
    assert FaultProxy("127.0.0.1", 6379, port=7000).address == "127.0.0.1:7000"
    assert FaultProxy("127.0.0.1", 6379, host="::1", port=7000).address == "[::1]:7000"


def test_url_for_rewrites_only_host_and_port() -> None:
    proxy = FaultProxy("127.0.0.1", 6379, port=7000)
    assert proxy.url_for("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:7000/0"
    assert (
        proxy.url_for("postgresql://user:pw@db.example:5432/test?sslmode=disable")
        == "postgresql://user:pw@127.0.0.1:7000/test?sslmode=disable"
    )
    assert proxy.url_for("etcd://localhost") == "etcd://127.0.0.1:7000"
    for bad in ("etcd://a:1,b:2", "127.0.0.1:6379", "redis:///0"):
        with pytest.raises(InvalidArgument):
            proxy.url_for(bad)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # redis.asyncio needs asyncio
async def test_redis_client_times_out_under_blackhole_and_recovers(proxy: FaultProxy) -> None:
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import TimeoutError as RedisTimeout

    url = proxy.url_for("redis://127.0.0.1:6379/0")
    client = Redis.from_url(url, socket_timeout=1.0, retry=Retry(NoBackoff(), 0))
    try:
        assert await client.ping()
        await proxy.blackhole()
        with pytest.raises(RedisTimeout):
            await client.ping()
        await proxy.pass_through()
        assert await client.ping()
    finally:
        await client.aclose()


class ProxyProcess:
    """``python -m aiolease.testing.proxy`` as a child, driven over its stdin."""

    def __init__(self, process: anyio.abc.Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self.stdin = process.stdin
        self.stdout = BufferedByteReceiveStream(process.stdout)

    async def line(self) -> str:
        return (await self.stdout.receive_until(b"\n", 4096)).decode()

    async def command(self, line: str) -> str:
        await self.stdin.send(line.encode() + b"\n")
        return await self.line()


async def test_process_mode_switches_over_stdin(
    redis_address: tuple[str, int], anyio_backend: str, dial: Dialer
) -> None:
    host, port = redis_address
    command = [sys.executable, "-m", "aiolease.testing.proxy", "--target", f"{host}:{port}"]
    async with await anyio.open_process([*command, "--backend", anyio_backend]) as process:
        child = ProxyProcess(process)
        greeting = await child.line()
        assert greeting.startswith("listening on 127.0.0.1:")
        proxy_port = int(greeting.rpartition(":")[2])
        client = await dial.to("127.0.0.1", proxy_port)
        assert await client.call("PING") == PONG

        assert await child.command("blackhole") == "ok blackhole"
        await client.send("PING")
        assert await client.nothing_within()
        assert (await child.command("stats")).startswith("ok blackhole latency=0 connections=1")
        assert await child.command("pass") == "ok pass"
        assert await client.line() == PONG

        assert await child.command("delay 0.2") == "ok delay"
        start = anyio.current_time()
        assert await client.call("PING") == PONG
        assert anyio.current_time() - start >= 0.4 * 0.99

        assert await child.command("refuse") == "ok refuse"
        with pytest.raises(OSError) as info:
            await dial.to("127.0.0.1", proxy_port)
        assert refused(info.value)
        assert await client.call("PING") == PONG

        assert await child.command("reset") == "ok reset"
        with pytest.raises(anyio.BrokenResourceError):
            await client.line()
        assert (await child.command("delay -1")).startswith("error ")
        assert (await child.command("warp")).startswith("error unknown command")
        assert await child.command("pass") == "ok pass"
        again = await dial.to("127.0.0.1", proxy_port)
        assert await again.call("PING") == PONG

        await child.stdin.aclose()  # end of input: the proxy stops
        assert await process.wait() == 0
        with pytest.raises(anyio.EndOfStream):
            await again.eof()


def test_process_mode_rejects_a_bad_target(capsys: pytest.CaptureFixture[str]) -> None:
    for target in ("127.0.0.1", "127.0.0.1:0", ":6379", "127.0.0.1:http"):
        with pytest.raises(SystemExit) as info:
            main(["--target", target])
        assert info.value.code == 2
    assert "HOST:PORT" in capsys.readouterr().err


# -- order and integrity under random switches ------------------------------------------------


#: How a reset shows on a client connection.
_CUT = (anyio.BrokenResourceError, anyio.EndOfStream, anyio.IncompleteRead, OSError)


class EchoLane:
    """One client's run of connections, each carrying pipelined ``ECHO`` commands.

    Every payload names its lane, connection and place, so that a reply that is
    duplicated, reordered, cut or meant for another connection matches no request.
    """

    RECORDS = 120  # per connection
    BIGGEST = 20_000  # bytes per payload: a chunk boundary falls inside many commands

    def __init__(self, lane: int, proxy: FaultProxy, seed: int) -> None:
        self.lane = lane
        self.proxy = proxy
        self.random = random.Random(seed)
        self.whole = 0  # connections on which every request was answered
        self.cut = 0  # connections a reset ended early
        self.replies = 0

    async def run(self, healed: anyio.Event) -> None:
        """Run connections until one opened after ``healed`` completes."""
        number = 0
        while True:
            after_heal = healed.is_set()
            number += 1
            await self._connection(number)
            if after_heal:
                return

    async def _connection(self, number: int) -> None:
        client = Client(await anyio.connect_tcp(self.proxy.host, self.proxy.port))
        sent: list[bytes] = []
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._send, client, number, sent)
                whole = await self._receive(client, number, sent)
                tg.cancel_scope.cancel()
        finally:
            await client.aclose()
        if whole:
            self.whole += 1
        else:
            self.cut += 1

    async def _receive(self, client: Client, number: int, sent: list[bytes]) -> bool:
        """Check each reply against its request; False if a reset cut the connection."""
        for place in range(self.RECORDS):
            try:
                reply = await client.bulk()
            except _CUT:
                return False  # the replies so far were each request's, in order
            assert reply == sent[place], (self.lane, number, place)
            self.replies += 1
        return True

    async def _send(self, client: Client, number: int, sent: list[bytes]) -> None:
        for place in range(self.RECORDS):
            tag = f"{self.lane}:{number}:{place}:".encode()
            payload = tag + self.random.randbytes(self.random.randrange(self.BIGGEST))
            sent.append(payload)  # before sending: the reply may come at once
            try:
                await client.send("ECHO", payload)
            except _CUT:
                return  # reset: the reader finds out too
            if self.random.random() < 0.1:
                await anyio.lowlevel.checkpoint()  # now and then let the reader catch up


async def _switch_at_random(proxy: FaultProxy, rng: random.Random, switches: int) -> None:
    """Blackhole, delay and reset once each, then ``switches`` random switches, each
    held a short while; then pass."""
    forced = [ProxyMode.BLACKHOLE, ProxyMode.DELAY, ProxyMode.RESET]
    weighted = [ProxyMode.PASS, ProxyMode.DELAY, ProxyMode.BLACKHOLE, ProxyMode.RESET]
    for mode in forced + rng.choices(weighted, weights=[35, 30, 30, 5], k=switches):
        latency = rng.uniform(0.001, 0.03) if mode is ProxyMode.DELAY else 0.0
        await proxy.set_mode(mode, latency)
        await anyio.sleep(rng.uniform(0.005, 0.06))
    await proxy.pass_through()


async def test_switches_never_duplicate_reorder_or_misdeliver_a_chunk(proxy: FaultProxy) -> None:
    """Pipelined ECHOs on several connections while the proxy flips at random among
    pass, delay, blackhole and reset: each connection's replies are its own requests'
    echoes, in order, each once; a reset only cuts the sequence short."""
    rng = random.Random()
    seed = rng.randrange(1 << 32)
    rng.seed(seed)
    lanes = [EchoLane(lane, proxy, rng.randrange(1 << 32)) for lane in range(4)]
    healed = anyio.Event()
    with anyio.fail_after(120):  # a hang guard, not a speed limit
        async with anyio.create_task_group() as tg:
            for lane in lanes:
                tg.start_soon(lane.run, healed)
            await _switch_at_random(proxy, rng, switches=30)
            healed.set()
    assert all(lane.whole >= 1 for lane in lanes), seed  # the last connection of each
    assert sum(lane.cut for lane in lanes) >= 1, seed  # the forced reset cut some
    assert proxy.statistics().held_bytes == 0
