"""Helpers for the etcd tests: opening backends, and etcd's HTTP/JSON gateway.

The gateway shows the server from outside (key ranges, the lease list, lease
revocation) over anyio sockets, so it works under asyncio and trio alike.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import (
    AsyncExitStack,
    asynccontextmanager,
    contextmanager,
)
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import Process

from aiolease._bridge import adapt, call_asyncio, running_trio
from aiolease.abc import Backend
from aiolease.backends.etcd import EtcdBackend
from aiolease.backends.etcd._url import parse_url
from tests import support
from tests.support import Opener, prefixed_opener

#: Bound on waiting for the cluster (elections take ~1-2 s; the machine is shared).
WAIT = 30.0
#: How often a test looks again at a server state that has no event (key counts).
LOOK_AGAIN = 0.02


def unique_prefix() -> str:
    return f"aiolease-test/{uuid.uuid4().hex[:12]}/"


@asynccontextmanager
async def open_etcd(
    url: str, cls: type[EtcdBackend] = EtcdBackend, **options: Any
) -> AsyncIterator[Backend]:
    """``open_backend`` for ``cls`` (a subclass the registry does not know)."""
    async with AsyncExitStack() as stack:
        if running_trio():
            import trio_asyncio

            if trio_asyncio.current_loop.get() is None:
                await stack.enter_async_context(trio_asyncio.open_loop())
            backend: Backend = await call_asyncio(lambda: cls.from_url(url, **options))
        else:
            backend = await cls.from_url(url, **options)
        bridged = adapt(backend)
        stack.push_async_callback(bridged.aclose)
        yield bridged


def inner(backend: Backend) -> EtcdBackend:
    """The :class:`EtcdBackend` behind ``backend`` (a bridge under trio)."""
    return support.inner(backend, EtcdBackend)


def opener(url: str, **options: Any) -> Opener:
    """Opens backends on ``url`` under one fresh prefix (``.prefix``)."""
    return prefixed_opener(url, options.pop("prefix", unique_prefix()), **options)


class Gateway:
    """etcd's HTTP/JSON gateway on the members of ``url``: the server seen from outside."""

    def __init__(self, url: str) -> None:
        self.endpoints = [(h, p) for h, p in addresses(url)]

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer: dict[str, Any] = json.loads(await self._http("POST", path, json.dumps(body)))
        return answer

    async def _http(self, method: str, path: str, body: str = "") -> bytes:
        """The body of the first member's answer to ``method path``."""
        problems = []
        for host, port in self.endpoints:
            payload = body.encode()
            head = f"{method} {path} HTTP/1.0\r\nHost: {host}\r\n"
            head += f"Content-Length: {len(payload)}\r\n\r\n"
            try:
                with anyio.fail_after(5):
                    async with await anyio.connect_tcp(host, port) as stream:
                        await stream.send(head.encode() + payload)
                        chunks = []
                        try:
                            while True:
                                chunks.append(await stream.receive())
                        except (anyio.EndOfStream, anyio.BrokenResourceError):
                            pass
            except (OSError, TimeoutError) as exc:
                problems.append(repr(exc))
                continue
            return b"".join(chunks).partition(b"\r\n\r\n")[2]
        raise AssertionError(f"no etcd member answered {path}: {problems}")

    async def requests(self) -> dict[str, int]:
        """gRPC messages the first member has received so far, by method (its metrics;
        the gateway's own requests count too, as gRPC calls)."""
        found: dict[str, int] = {}
        for line in (await self._http("GET", "/metrics")).decode().splitlines():
            match = re.match(r'grpc_server_msg_received_total\{grpc_method="(\w+)".*\} (\S+)', line)
            if match and float(match[2]):
                found[match[1]] = int(float(match[2]))
        return found

    async def delete(self, key: str) -> None:
        await self.post("/v3/kv/deleterange", {"key": _b64(key.encode())})

    async def keys(self, prefix: str) -> list[dict[str, Any]]:
        """Every key under ``prefix``: ``key`` (str), ``value`` (bytes), ``lease``, revisions."""
        start = prefix.encode()
        end = start[:-1] + bytes([start[-1] + 1])
        body = {"key": _b64(start), "range_end": _b64(end)}
        found = (await self.post("/v3/kv/range", body)).get("kvs", [])
        return [
            {
                "key": base64.b64decode(kv["key"]).decode(),
                "value": base64.b64decode(kv.get("value", "")),
                "lease": int(kv.get("lease", 0)),
                "create_revision": int(kv["create_revision"]),
            }
            for kv in found
        ]

    async def revision(self) -> int:
        """The server's revision now."""
        answer = await self.post("/v3/kv/range", {"key": _b64(b"\0"), "count_only": True})
        return int(answer["header"]["revision"])

    async def written(self, prefix: str, after: int) -> list[str]:
        """The key of every put under ``prefix`` after revision ``after``, in order (the
        server's history, by a watch: deleted keys too). Up to now: a mark put under
        ``prefix`` ends it (and is left out)."""
        mark = (prefix + "~mark").encode()
        put = await self.post("/v3/kv/put", {"key": _b64(mark), "value": ""})
        until = int(put["header"]["revision"])
        start = prefix.encode()
        end = start[:-1] + bytes([start[-1] + 1])
        create = {"key": _b64(start), "range_end": _b64(end), "start_revision": str(after + 1)}
        payload = json.dumps({"create_request": create}).encode()
        host, port = self.endpoints[0]
        head = f"POST /v3/watch HTTP/1.0\r\nHost: {host}\r\n"
        head += f"Content-Length: {len(payload)}\r\n\r\n"
        keys: list[str] = []
        decoder = json.JSONDecoder()
        with anyio.fail_after(WAIT):
            async with await anyio.connect_tcp(host, port) as stream:
                await stream.send(head.encode() + payload)
                received = b""
                while b"\r\n\r\n" not in received:
                    received += await stream.receive()
                body = received.partition(b"\r\n\r\n")[2].decode()
                while True:  # one JSON object per watch reply, as they come
                    body = body.lstrip()
                    try:
                        reply, used = decoder.raw_decode(body)
                    except ValueError:
                        body += (await stream.receive()).decode()
                        continue
                    body = body[used:]
                    for event in reply.get("result", {}).get("events", []):
                        kv = event["kv"]
                        if int(kv["mod_revision"]) >= until:
                            return keys
                        if event.get("type", "PUT") == "PUT":
                            keys.append(base64.b64decode(kv["key"]).decode())

    async def owners(self, prefix: str) -> dict[str, str]:
        """The owner of every key under ``prefix``, by key: the value names it, or (a key
        whose value does not: fair mode) the key ends with it."""
        found = {}
        for kv in await self.keys(prefix):
            owner = json.loads(kv["value"]).get("owner")
            found[kv["key"]] = owner if owner is not None else kv["key"].rpartition("/")[2]
        return found

    async def lease_ttl(self, lease_id: int) -> tuple[int, int]:
        """``(remaining TTL, granted TTL)``; remaining is -1 when the lease does not exist."""
        answer = await self.post("/v3/lease/timetolive", {"ID": lease_id})
        return int(answer.get("TTL", -1)), int(answer.get("grantedTTL", 0))

    async def leases(self) -> set[int]:
        answer = await self.post("/v3/lease/leases", {})
        return {int(lease["ID"]) for lease in answer.get("leases", [])}

    async def revoke(self, lease_id: int) -> None:
        await self.post("/v3/lease/revoke", {"ID": lease_id})

    async def wait_keys(self, prefix: str, count: int) -> None:
        """Wait until ``prefix`` holds ``count`` keys (no event says so: look again)."""
        with anyio.fail_after(WAIT):
            while len(await self.keys(prefix)) != count:  # noqa: ASYNC110 - no event here
                await anyio.sleep(LOOK_AGAIN)


@contextmanager
def raises(kind: type[BaseException], match: str) -> Iterator[None]:
    """``pytest.raises`` that also finds ``kind`` alone inside exception groups: under
    trio, ``open_backend`` runs ``from_url`` in a trio-asyncio loop whose nursery wraps
    what it raises."""
    try:
        yield
    except BaseException as exc:
        leaf: BaseException = exc
        while len(getattr(leaf, "exceptions", ())) == 1:
            leaf = leaf.exceptions[0]  # type: ignore[attr-defined]
        if isinstance(leaf, kind) and re.search(match, str(leaf)):
            return
        raise
    pytest.fail(f"did not raise {kind.__name__}")


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def addresses(url: str) -> list[tuple[str, int]]:
    parsed = parse_url(url, {})
    return list(parsed.endpoints)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PrivateEtcd:
    """A single etcd node of a test's own, on free ports, with its data in ``data_dir``.

    A :class:`~aiolease.testing.safety.ServerControl`: :meth:`kill` is a ``SIGKILL`` (a
    crash), :meth:`start` starts it again on the same ports and data, as after a
    reboot. The shared test servers are never touched.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self._process: Process | None = None

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def _command(self) -> list[str]:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            *("etcd", "--name", "private", "--data-dir", str(self.data_dir / "data")),
            *("--listen-client-urls", client, "--advertise-client-urls", client),
            *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
            *("--initial-cluster", f"private={peer}", "--logger", "zap"),
        ]

    async def start(self) -> None:
        """Start it and wait until it serves requests."""
        assert self._process is None, "already running"
        log = (self.data_dir / "etcd.log").open("ab")
        try:
            self._process = await anyio.open_process(
                self._command(), stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        finally:
            log.close()
        gateway = Gateway(self.url)
        with anyio.fail_after(WAIT):
            while True:
                try:
                    await gateway.post("/v3/maintenance/status", {})
                    return
                except (AssertionError, ValueError):  # not serving yet: no event says when
                    assert self._process.returncode is None, "etcd exited; see etcd.log"
                    await anyio.sleep(LOOK_AGAIN)

    async def kill(self) -> None:
        """``SIGKILL`` it and wait until it is gone."""
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            with anyio.CancelScope(shield=True):
                await process.wait()
                await process.aclose()


@asynccontextmanager
async def private_etcd(data_dir: Path) -> AsyncIterator[PrivateEtcd]:
    """A :class:`PrivateEtcd`, started, and killed on exit."""
    await anyio.Path(data_dir).mkdir(parents=True, exist_ok=True)
    etcd = PrivateEtcd(data_dir)
    await etcd.start()
    try:
        yield etcd
    finally:
        await etcd.kill()
