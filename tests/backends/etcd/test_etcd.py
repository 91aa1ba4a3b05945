"""The etcd backend against real etcd: the single node and the 3-member cluster of
``scripts/services.sh``, under asyncio and trio.

Every test writes under a key prefix of its own and deletes only what it wrote; the
server is inspected from outside through etcd's HTTP/JSON gateway
(:class:`tests.backends.etcd.support.Gateway`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

import aiolease
from aiolease import (
    Capability,
    InvalidArgument,
)
from aiolease._bridge import call_asyncio, running_trio
from aiolease.abc import Grant
from aiolease.backends.etcd import EtcdBackend
from aiolease.backends.etcd._url import parse_url
from aiolease.testing import CHECKS, Check
from aiolease.testing.model import make_model_machine
from tests.backends.etcd.support import (
    addresses,
    inner,
    opener,
    raises,
    unique_prefix,
)

pytestmark = pytest.mark.anyio


# -- the contract ----------------------------------------------------------------------


@pytest.mark.parametrize("check", [c for _, c in CHECKS], ids=[n for n, _ in CHECKS])
async def test_conformance(
    anyio_backend: str, etcd_url: str, single_url: str, check: Check
) -> None:
    """On the single node in plain mode under asyncio, and in fair mode under trio (the
    loops and modes paired, docs/testing.md "Keeping the suite short"); on the cluster
    in plain mode under both loops."""
    fair = anyio_backend == "trio" and etcd_url == single_url
    await check(opener(etcd_url, fair=fair) if fair else opener(etcd_url))


@pytest.mark.parametrize(("server", "loop"), [("etcd", "asyncio"), ("etcd-cluster", "trio")])
def test_agrees_with_the_model(
    aiolease_server: Callable[[str], str], server: str, loop: str
) -> None:
    """Once per loop, the single node under asyncio and the cluster under trio."""
    url = aiolease_server(server)
    machine = make_model_machine(opener(url), anyio_backend=loop, exact_tokens=False)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=20,
            stateful_step_count=40,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# -- URLs and options --------------------------------------------------------------------


def test_urls_name_every_endpoint() -> None:
    parsed = parse_url("etcd://u%40x:p%3Aw@10.0.0.1,h2:2380,[::1]:23790?fair=1", {"prefix": "p/"})
    assert parsed.endpoints == (("10.0.0.1", 2379), ("h2", 2380), ("::1", 23790))
    assert parsed.user == ("u@x", "p:w")
    assert dict(parsed.options) == {"fair": "1", "prefix": "p/"}
    assert "p:w" not in parsed.described()


@pytest.mark.parametrize(
    ("url", "options", "match"),
    [
        ("redis://127.0.0.1", {}, "etcd://"),
        ("etcd://", {}, "no endpoint"),
        ("etcd://h:port", {}, "bad port"),
        ("etcd://h:70000", {}, "out of range"),
        ("etcd://h/some/path", {}, "no path"),
        ("etcd://h?nosuch=1", {}, "unknown etcd option"),
        ("etcd://h", {"nosuch": 1}, "unknown etcd option"),
        ("etcd://h?fair=1", {"fair": True}, "given in the URL and as arguments"),
    ],
)
def test_bad_urls_are_invalid(url: str, options: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        parse_url(url, options)


@pytest.mark.parametrize(
    ("query", "match"),
    [
        ("fair=maybe", "yes/no"),
        ("timeout=soon", "not a number"),
        ("timeout=0", "timeout"),
        ("tls=0&ca_file=/nonexistent", "tls=0"),
        ("ca_file=/nonexistent/ca.pem", "ca_file"),
    ],
)
async def test_bad_options_are_invalid(anyio_backend: str, query: str, match: str) -> None:
    with raises(InvalidArgument, match=match):
        async with aiolease.open_backend(f"etcd://127.0.0.1:2379?{query}"):
            pass  # pragma: no cover


async def test_an_unreachable_server_is_unavailable(anyio_backend: str) -> None:
    with raises(aiolease.BackendUnavailable, match="127.0.0.1:1"):
        async with aiolease.open_backend("etcd://127.0.0.1:1?timeout=2"):
            pass  # pragma: no cover


async def test_capabilities(anyio_backend: str, single_url: str) -> None:
    common = {
        Capability.PUSH_WAKEUP,
        Capability.SERVER_TIME,
        Capability.DURABLE_TOKENS,
        Capability.SESSION,
        Capability.MULTI_PROCESS,
        Capability.PROCLAIM,
        Capability.SEMAPHORE,
        Capability.FAIR_PERMITS,  # permits queue in both modes
        Capability.PERMIT_RETRY_KEEPS_ENTRY,
    }
    async with opener(single_url)() as plain, opener(single_url, fair=True)() as fair:
        assert plain.capabilities == common
        assert fair.capabilities == common | {Capability.FAIR_QUEUE}
        assert "fair" in repr(inner(fair)) and "fair" not in repr(inner(plain))


async def test_a_users_client_is_used_and_never_closed(anyio_backend: str, single_url: str) -> None:
    host, port = addresses(single_url)[0]
    prefix = unique_prefix()
    async with AsyncExitStack() as stack:
        if running_trio():
            import trio_asyncio

            await stack.enter_async_context(trio_asyncio.open_loop())

        async def scenario() -> tuple[int, int]:
            import aetcd

            client = aetcd.Client(host, port)
            try:
                async with EtcdBackend(client, prefix=prefix) as backend:
                    grant = await backend.try_acquire("n", "o", 5, "me", {})
                    assert isinstance(grant, Grant)
                assert client.channel is not None  # still open
                left = await client.get_prefix(prefix.encode())
                return grant.token, len(left)
            finally:
                await client.close()

        if running_trio():
            token, left = await call_asyncio(scenario)
        else:
            token, left = await scenario()
    assert token > 0
    assert left == 0  # closing the backend revoked its session, and the key with it
