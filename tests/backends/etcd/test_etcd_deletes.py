"""Deletes sent while every place of the wire is taken go together in one ``Txn``
(:mod:`aiolease.backends.etcd._deletes`), on the real server: each answers what its
own ``DeleteRange`` would have, and a server that allows fewer operations per ``Txn``
gets them one by one.

The wire lives on the backend's asyncio loop: asyncio only.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest
from aetcd import rpc

from aiolease import BackendUnavailable
from aiolease.backends.etcd import _deletes
from aiolease.backends.etcd._wire import MAX_IN_FLIGHT, Wire
from tests.backends.etcd.support import Gateway, inner, opener
from tests.support import Opener

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]


def _request(key: str) -> Any:
    return rpc.DeleteRangeRequest(key=key.encode())


def _take_every_place(wire: Wire) -> None:
    limiter = wire._limiter
    for _ in range(MAX_IN_FLIGHT):
        assert limiter.take()


def _give_every_place_back(wire: Wire) -> None:
    for _ in range(MAX_IN_FLIGHT):
        wire._limiter.give_back()


async def _put(gateway: Gateway, keys: list[str]) -> None:
    for key in keys:
        await gateway.post("/v3/kv/put", {"key": _b64(key), "value": _b64("x")})


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def _present(single_url: str, count: int) -> tuple[Opener, str, Gateway, list[str]]:
    """An opener under a fresh prefix, its prefix, the gateway, and ``count`` keys put
    under it."""
    open_ = opener(single_url)
    prefix: str = open_.prefix  # type: ignore[attr-defined]
    gateway = Gateway(single_url)
    keys = [f"{prefix}k{i}" for i in range(count)]
    await _put(gateway, keys)
    return open_, prefix, gateway, keys


async def _waiting(wire: Wire, keys: list[str]) -> list[asyncio.Task[Any]]:
    """Deletes of ``keys`` started while every place of ``wire`` is taken, gathered
    (one loop pass); the caller gives the places back."""
    _take_every_place(wire)
    deletes = [asyncio.ensure_future(wire.delete(_request(k))) for k in keys]
    await asyncio.sleep(0)
    assert not any(d.done() for d in deletes)  # waiting for a place, gathered
    return deletes


async def test_deletes_that_wait_for_a_place_share_a_txn(
    anyio_backend: str, single_url: str
) -> None:
    open_, prefix, gateway, present = await _present(single_url, 200)
    async with open_() as backend:
        wire = inner(backend)._wire
        keys = [*present, f"{prefix}missing", present[0]]  # the last deletes a key again
        deletes = await _waiting(wire, keys)
        _give_every_place_back(wire)
        answers = await asyncio.gather(*deletes)
        # 128, then the other 72 and the missing key; the repeated key opens a third
        # batch, of one delete (not counted: sent as it would be alone).
        assert wire.delete_batches == 2
        assert inner(backend).statistics().delete_batches == 2
        deleted = [a.deleted for a in answers]
        assert deleted[1:200] == [1] * 199 and deleted[200] == 0  # the missing key
        # The two deletes of one key went in two requests sent at once: either is first.
        assert sorted([deleted[0], deleted[201]]) == [0, 1]
        assert wire._limiter.free == MAX_IN_FLIGHT
    assert await gateway.keys(prefix) == []


async def test_a_server_that_allows_fewer_ops_per_txn_gets_them_one_by_one(
    anyio_backend: str, single_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd refuses a ``Txn`` of more operations than ``--max-txn-ops`` (128 by default)
    before applying any: every delete of it is sent on its own, and later batches
    are smaller."""
    monkeypatch.setattr(_deletes, "MOST", 200)
    open_, prefix, gateway, keys = await _present(single_url, 150)
    async with open_() as backend:
        wire = inner(backend)._wire
        deletes = await _waiting(wire, keys)
        _give_every_place_back(wire)
        answers = await asyncio.gather(*deletes)
        assert [a.deleted for a in answers] == [1] * 150
        assert wire.delete_batches == 0  # the server refused the one batch of 150
        assert await gateway.keys(prefix) == []
        await _put(gateway, keys)
        deletes = await _waiting(wire, keys)
        _give_every_place_back(wire)
        assert [a.deleted for a in await asyncio.gather(*deletes)] == [1] * 150
        assert wire.delete_batches == 2  # 75 and 75: half of what was refused
        assert wire._limiter.free == MAX_IN_FLIGHT
    assert await gateway.keys(prefix) == []


async def test_a_caller_that_stops_waiting_leaves_the_batch_whole(
    anyio_backend: str, single_url: str
) -> None:
    open_, prefix, gateway, keys = await _present(single_url, 3)
    async with open_() as backend:
        wire = inner(backend)._wire
        deletes = await _waiting(wire, keys)
        deletes[0].cancel()
        _give_every_place_back(wire)
        answers = await asyncio.gather(*deletes[1:])
        assert deletes[0].cancelled()
        assert [a.deleted for a in answers] == [1, 1]
        assert wire.delete_batches == 1
    assert await gateway.keys(prefix) == []  # the cancelled caller's key went too


async def test_deletes_still_waiting_when_the_backend_closes_are_told_so(
    anyio_backend: str, single_url: str
) -> None:
    open_ = opener(single_url)
    async with open_() as backend:
        wire = inner(backend)._wire
        _take_every_place(wire)
        waiting = asyncio.ensure_future(wire.delete(_request("never-sent")))
        await asyncio.sleep(0)
    with pytest.raises(BackendUnavailable, match="closed"):
        await waiting
    # Its places are all still taken: a delete would wait for one, on a closed wire.
    with pytest.raises(BackendUnavailable, match="closed"):
        await wire.delete(_request("never-sent-either"))
