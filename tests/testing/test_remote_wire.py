"""The remote backend's wire: every reply answers its own request (under faults and
cancellations), request ids, URLs, bad servers, and a server in another process."""

from __future__ import annotations

import itertools
import json
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
import pytest
from anyio.abc import Process, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

import aiolease
from aiolease import (
    AsyncLock,
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    InvalidArgument,
    LeaseLostError,
    LossReason,
)
from aiolease.abc import Backend, Grant, HolderInfo
from aiolease.backends.memory import MemoryBackend
from aiolease.testing.proxy import FaultProxy, ProxyMode
from aiolease.testing.remote import PROTOCOL, RemoteBackend
from tests.testing.remote_support import owner, serving

pytestmark = pytest.mark.anyio


# -- every reply answers its own request ----------------------------------------------------


def _serial(name: str) -> int:
    return int(name.rpartition("-")[2])


def _echo_holder(name: str) -> HolderInfo:
    """The holder :class:`_Echo` reports for ``name``: made of the name's serial.

    Every fifth one is large, so that its reply spans several proxy chunks (and a
    blackhole can hold half of a line).
    """
    n = _serial(name)
    pad = "x" * (100_000 if n % 5 == 0 else n % 50)
    return HolderInfo(name, f"owner-{n}", f"id-{n}", n, {"pad": pad}, float(n))


class _Echo(Backend):
    """Answers each call with a value made of its own request, after a random pause
    (none, short, or past the shorter request timeouts), so that a reply names the
    request it answers. Requests that arrive altered are listed in :attr:`wrong`."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.wrong: list[str] = []

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> _Echo:
        return cls(random.Random())

    async def _arrived(self, name: str, owner: str) -> None:
        if owner != f"owner-{_serial(name)}":
            self.wrong.append(f"request {name} arrived with owner {owner!r}")
        roll = self.rng.random()
        if roll < 0.4:
            await anyio.lowlevel.checkpoint()
        else:
            await anyio.sleep(self.rng.uniform(0, 0.01) if roll < 0.95 else 0.08)

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        await self._arrived(name, owner)
        return Grant(_serial(name), ttl) if _serial(name) % 2 else _echo_holder(name)

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        await self._arrived(name, owner)
        return Grant(token, ttl)

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        await self._arrived(name, owner)
        return _serial(name) % 3 == 0

    async def read(self, name: str) -> HolderInfo | None:
        await self._arrived(name, f"owner-{_serial(name)}")
        return _echo_holder(name) if _serial(name) % 4 else None

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        await self._arrived(name, f"owner-{_serial(name)}")
        if seen != _echo_holder(name):
            self.wrong.append(f"wait_changed {name} arrived with {seen!r:.80}")


OPS = ("try_acquire", "renew", "release", "read", "wait_changed")


async def _echo_call(client: Backend, op: str, n: int) -> str | None:
    """Call ``op`` for request ``n`` on ``client``; what is wrong with the answer, if anything."""
    name, owner = f"req-{n}", f"owner-{n}"
    got: object
    expected: object
    if op == "try_acquire":
        got = await client.try_acquire(name, owner, 1.0 + n, "me", {})
        expected = Grant(n, 1.0 + n) if n % 2 else _echo_holder(name)
    elif op == "renew":
        got = await client.renew(name, owner, 7 * n, 2.0 + n)
        expected = Grant(7 * n, 2.0 + n)
    elif op == "release":
        got, expected = await client.release(name, owner, n), n % 3 == 0
    elif op == "read":
        got = await client.read(name)
        expected = _echo_holder(name) if n % 4 else None
    else:
        await client.wait_changed(name, _echo_holder(name))
        got = expected = None  # a reply with a value would have been a BackendError
    return None if got == expected else f"{op} {name} was answered {got!r:.120}"


class _Hammer:
    """Calls at random, with random request timeouts and cancellations; tallies outcomes."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.serials = itertools.count(1)
        self.tally: Counter[str] = Counter()
        self.wrong: list[str] = []

    async def run(self, client: RemoteBackend) -> None:
        while True:
            await self.call_once(client)

    async def call_once(self, client: RemoteBackend) -> None:
        op, n = self.rng.choice(OPS), next(self.serials)
        client.request_timeout = self.rng.choice([0.002, 0.01, 0.03, None, 5.0, 5.0, 5.0])
        try:
            with anyio.move_on_after(self.rng.choice([0.002, 0.01, 0.03, None, None, None])):
                wrong = await _echo_call(client, op, n)
                self.tally["answered"] += 1
                if wrong is not None:
                    self.wrong.append(wrong)
                return
            self.tally["cancelled"] += 1
        except BackendTimeout:
            self.tally["timed out"] += 1
        except BackendUnavailable:
            self.tally["unavailable"] += 1
        except BackendError as exc:  # a reply that did not answer its request, say
            self.wrong.append(f"{op} req-{n} failed: {exc!r:.200}")


async def _flip_proxy(proxy: FaultProxy, rng: random.Random, switches: int) -> None:
    """Blackhole, delay and reset once each, then ``switches`` random switches, each
    held a short while; then pass."""
    forced = [ProxyMode.BLACKHOLE, ProxyMode.DELAY, ProxyMode.RESET]
    weighted = [ProxyMode.PASS, ProxyMode.DELAY, ProxyMode.BLACKHOLE, ProxyMode.RESET]
    for mode in forced + rng.choices(weighted, weights=[35, 30, 30, 5], k=switches):
        latency = rng.uniform(0.001, 0.02) if mode is ProxyMode.DELAY else 0.0
        await proxy.set_mode(mode, latency)
        await anyio.sleep(rng.uniform(0.005, 0.05))
    await proxy.pass_through()


async def test_every_reply_answers_its_request_under_faults_and_cancellations() -> None:
    """Many concurrent calls, each cancelled or timed out at random, through a proxy
    flipped among pass, delay, blackhole and reset: every answer a client takes is
    the one to the request it sent, and every request arrives as it was sent."""
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    served, hammer = _Echo(rng), _Hammer(rng)
    async with serving(served) as url, FaultProxy("127.0.0.1", _port(url)) as proxy:
        clients = [await RemoteBackend.from_url(proxy.url_for(url), max_idle=2) for _ in range(3)]
        try:
            with anyio.fail_after(60):  # a hang guard, not a speed limit
                async with anyio.create_task_group() as tg:
                    for client in clients * 6:
                        tg.start_soon(hammer.run, client)
                    await _flip_proxy(proxy, rng, switches=70)
                    tg.cancel_scope.cancel()
                assert hammer.wrong == [], (seed, hammer.tally)
                assert served.wrong == [], seed
                for client in clients:  # healed: each one answers right at once
                    client.request_timeout = 30.0
                    for op in OPS:
                        assert await _echo_call(client, op, next(hammer.serials)) is None
        finally:
            for client in clients:
                await client.aclose()
    tally = hammer.tally
    assert min(tally["answered"], tally["cancelled"], tally["timed out"]) > 0, (seed, tally)


# -- request ids ----------------------------------------------------------------------------------


class _Scripted:
    """A server that answers ``hello`` right and every other request with :attr:`answer`;
    counts connections and tells when one is closed."""

    def __init__(self, answer: Callable[[int], bytes]) -> None:
        self.answer = answer
        self.accepted = 0
        self.hung_up = anyio.Event()

    async def serve(self, stream: SocketStream) -> None:
        self.accepted += 1
        reader = BufferedByteReceiveStream(stream)
        async with stream:
            try:
                while True:
                    request = json.loads(await reader.receive_until(b"\n", 1 << 20))
                    if request["op"] == "hello":
                        value = {
                            "protocol": PROTOCOL,
                            "capabilities": [],
                            "poll_interval": 1,
                            "renews_many": False,
                        }
                        await stream.send(json.dumps({"id": request["id"], "ok": value}).encode())
                        await stream.send(b"\n")
                    elif request["op"] == "read":
                        await stream.send(b'{"id": %d, "ok": null}\n' % request["id"])
                    else:
                        await stream.send(self.answer(request["id"]))
            except (anyio.IncompleteRead, anyio.BrokenResourceError):
                self.hung_up.set()


@asynccontextmanager
async def scripted(answer: Callable[[int], bytes]) -> AsyncIterator[tuple[_Scripted, str]]:
    server = _Scripted(answer)
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, server.serve)
            yield server, f"remote://127.0.0.1:{port}"
            tg.cancel_scope.cancel()


@pytest.mark.parametrize(
    "answer",
    [
        lambda i: b'{"id": %d, "ok": true}\n' % (i - 1),  # the one before's, held back
        lambda i: b'{"id": %d, "ok": true}\n' % (i + 1),
        lambda i: b'{"id": null, "ok": true}\n',
        lambda i: b'{"ok": true}\n',
        lambda i: b'{"id": "%d", "ok": true}\n' % i,
        lambda i: b'{"id": %d, "ok": {"token": 6, "ttl": 1, "lead": null}}\n' % i,
        lambda i: b'{"id": %d}\n' % i,
        lambda i: b'{"id": %d, "ok": true, "error": null}\n' % i,
        lambda i: b'{"id": %d, "error": {"type": 1}}\n' % i,
    ],
    ids=["stale", "ahead", "null", "none", "text", "grant", "empty", "both", "bad-error"],
)
async def test_a_reply_that_does_not_answer_its_request_fails_and_closes_the_connection(
    answer: Callable[[int], bytes],
) -> None:
    async with scripted(answer) as (server, url), aiolease.open_backend(url) as client:
        assert await client.read("n") is None
        with pytest.raises(BackendError) as info:
            await client.release("n", owner(1), 1)
        assert type(info.value) is BackendError
        with anyio.fail_after(10):  # a hang guard: the client hangs up
            await server.hung_up.wait()
        assert await client.read("n") is None  # on a new connection
        assert server.accepted == 2


async def test_a_reply_held_past_its_timeout_never_answers_a_later_call() -> None:
    """The harness's blackhole case: a renew times out while the proxy holds it; once
    traffic flows again its grant must not pass for the answer to the release."""
    async with serving(MemoryBackend()) as url, FaultProxy("127.0.0.1", _port(url)) as proxy:
        async with aiolease.open_backend(proxy.url_for(url), max_idle=1) as client:
            assert isinstance(client, RemoteBackend)
            grant = await client.try_acquire("n", owner(1), 30, "me", {})
            assert isinstance(grant, Grant)
            await proxy.blackhole()
            client.request_timeout = 0.05
            with pytest.raises(BackendTimeout):
                await client.renew("n", owner(1), grant.token, 30)
            await proxy.pass_through()
            client.request_timeout = 30.0
            assert await client.release("n", owner(1), grant.token) is True
            assert await client.read("n") is None


def _port(url: str) -> int:
    return int(url.rpartition(":")[2])


# -- URLs and the wire ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "remote://",
        "remote://127.0.0.1",
        "remote://127.0.0.1:0",
        "remote://127.0.0.1:99999",
        "remote://127.0.0.1:port",
        "remote://:7000",
        "remote://user@127.0.0.1:7000",
        "remote://127.0.0.1:7000/path",
        "remote://127.0.0.1:7000#frag",
        "remote://127.0.0.1:7000?nosuch=1",
        "remote://127.0.0.1:7000?max_idle=-1",
        "remote://127.0.0.1:7000?max_idle=1.5",
        "remote://127.0.0.1:7000?request_timeout=0",
        "remote://127.0.0.1:7000?connect_timeout=soon",
        "remote://127.0.0.1:7000?max_idle",
        "memory://127.0.0.1:7000",
    ],
)
async def test_bad_urls_are_invalid_arguments(url: str) -> None:
    with pytest.raises(InvalidArgument):
        await RemoteBackend.from_url(url)


async def test_bad_options_are_invalid_arguments() -> None:
    with pytest.raises(InvalidArgument, match="nosuch"):
        await RemoteBackend.from_url("remote://127.0.0.1:7000", nosuch=1)
    with pytest.raises(InvalidArgument, match="max_idle"):
        await RemoteBackend.from_url("remote://127.0.0.1:7000", max_idle=True)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_no_server_is_unavailable() -> None:
    with pytest.raises(BackendUnavailable):
        async with aiolease.open_backend(f"remote://127.0.0.1:{_closed_port()}"):
            pass


async def _answer_nonsense(stream: SocketStream) -> None:
    async with stream:
        await BufferedByteReceiveStream(stream).receive_until(b"\n", 1 << 20)
        await stream.send(b"-ERR unknown command\r\n")


async def test_another_kind_of_server_is_a_backend_error() -> None:
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, _answer_nonsense)
            with pytest.raises(BackendError) as info:
                await RemoteBackend.from_url(f"remote://127.0.0.1:{port}")
            assert type(info.value) is BackendError
            tg.cancel_scope.cancel()


async def test_the_server_answers_bad_requests_and_goes_on() -> None:
    async with serving(MemoryBackend()) as url:
        port = int(url.rpartition(":")[2])
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            reader = BufferedByteReceiveStream(stream)

            async def ask(line: bytes) -> dict[str, Any]:
                await stream.send(line + b"\n")
                reply: dict[str, Any] = json.loads(await reader.receive_until(b"\n", 1 << 20))
                return reply

            bad_requests = [
                b"not json",
                b"[1]",
                b'{"op": "nope"}',
                b'{"op": "read", "args": {}}',
                b'{"id": "7", "op": "hello"}',
                b'{"id": true, "op": "hello"}',
            ]
            for bad in bad_requests:
                reply = await ask(bad)
                assert reply["error"]["type"] == "InvalidArgument", bad
                assert reply["id"] is None, bad
            hello = await ask(b'{"op": "hello"}')
            assert hello["ok"]["protocol"] == PROTOCOL and hello["id"] is None
            assert (await ask(b'{"id": 7, "op": "read", "args": {}}'))["id"] == 7  # even errors
            assert await ask(b'{"id": 8, "op": "read", "args": {"name": "n"}}') == {
                "id": 8,
                "ok": None,
            }
            with pytest.raises((anyio.IncompleteRead, anyio.BrokenResourceError)):
                await stream.send(b"x" * (2 << 20) + b"\n")  # too long: the server hangs up
                await reader.receive_until(b"\n", 1 << 20)


# -- a server in another process -------------------------------------------------------------

SERVER = [sys.executable, "-m", "aiolease.testing.remote", "--url", "memory://"]


async def _listening_port(proc: Process) -> int:
    assert proc.stdout is not None
    with anyio.fail_after(30):
        line = await BufferedByteReceiveStream(proc.stdout).receive_until(b"\n", 1000)
    text = line.decode()
    assert text.startswith("listening on 127.0.0.1:"), text
    return int(text.rpartition(":")[2])


@asynccontextmanager
async def server_process(port: int = 0) -> AsyncIterator[tuple[Process, int]]:
    """``python -m aiolease.testing.remote`` serving a memory backend; yields its port."""
    async with await anyio.open_process([*SERVER, "--port", str(port)], stderr=None) as proc:
        try:
            yield proc, await _listening_port(proc)
        finally:
            if proc.returncode is None:
                proc.kill()
            with anyio.CancelScope(shield=True):
                await proc.wait()


async def test_a_killed_server_loses_the_lease_as_unreachable_and_a_new_one_serves() -> None:
    async with server_process() as (proc, port):
        async with aiolease.open_backend(f"remote://127.0.0.1:{port}") as backend:
            lock = AsyncLock(backend, "held", ttl=1.0)
            with anyio.fail_after(20), pytest.raises(LeaseLostError) as info:  # a hang guard
                async with lock as lease:
                    assert lease.token == 1
                    proc.kill()
                    await proc.wait()
                    await anyio.sleep_forever()
            assert info.value.reason is LossReason.UNREACHABLE
            assert lock.statistics().losses == {LossReason.UNREACHABLE: 1}
            with pytest.raises(BackendUnavailable):
                await backend.read("held")
            async with server_process(port):
                # The same client reconnects. A restarted memory backend starts over:
                # its tokens are not durable (no DURABLE_TOKENS capability).
                async with lock as lease:
                    assert lease.token == 1


class Hold(NamedTuple):
    """One process's stay in the protected body, on the host's monotonic clock."""

    start: float
    end: float
    token: int
    worker: int


CONTENDER = """
import json, random, sys, time
import anyio
import aiolease

async def contend(url, worker, rounds, start_at):
    async with aiolease.open_backend(url) as backend:
        lock = aiolease.AsyncLock(backend, "contended", ttl=2.0, identity=f"worker-{worker}")
        await anyio.sleep(max(start_at - time.monotonic(), 0.0))
        for _ in range(rounds):
            async with lock as lease:
                start = time.monotonic()
                try:
                    await anyio.sleep(random.uniform(0.1, 1.2) * lock.timing.renew_interval)
                finally:
                    end = time.monotonic()
            record = {"start": start, "end": end, "token": lease.token, "worker": worker}
            print(json.dumps(record), flush=True)
            await anyio.sleep(random.uniform(0.0, 0.03))

url, worker, rounds, start_at, loop = sys.argv[1:]
anyio.run(contend, url, int(worker), int(rounds), float(start_at), backend=loop)
"""


@pytest.mark.slow
def test_client_processes_on_both_loops_share_a_server_process() -> None:
    rounds = 4
    procs: list[subprocess.Popen[str]] = []
    try:
        server = subprocess.Popen([*SERVER, "--loop", "trio"], stdout=subprocess.PIPE, text=True)
        procs.append(server)
        assert server.stdout is not None
        url = f"remote://127.0.0.1:{server.stdout.readline().rpartition(':')[2].strip()}"
        start_at = repr(time.monotonic() + 1.0)  # both contend from the same moment
        for worker, loop in enumerate(["asyncio", "trio"]):
            argv = [sys.executable, "-c", CONTENDER, url, str(worker), str(rounds), start_at, loop]
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
        outputs = [client.communicate(timeout=60)[0] for client in procs[1:]]
        assert [client.returncode for client in procs[1:]] == [0, 0], outputs
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    holds = sorted(Hold(**json.loads(line)) for out in outputs for line in out.splitlines())
    assert len(holds) == 2 * rounds and {h.worker for h in holds} == {0, 1}
    for before, after in zip(holds, holds[1:], strict=False):
        assert before.start < before.end <= after.start, (before, after)
        assert before.token < after.token, (before, after)
