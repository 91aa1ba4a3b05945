"""The permit checks of the conformance suite catch broken backends.

The checks themselves run on every configured backend in ``test_conformance.py``
(memory and SQLite by default, under asyncio and trio); each mutant here breaks one
rule of ``docs/internals/semaphores.md`` in the memory backend, and the check of
that rule must fail on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import anyio
import pytest

import aiolease
from aiolease.abc import Backend, Capability, Grant, HolderInfo
from aiolease.backends.memory import MemoryBackend, _Record
from aiolease.testing.conformance import (
    Check,
    check_permit_bad_arguments_rejected,
    check_permit_expiry_frees,
    check_permit_limit_checked,
    check_permit_limit_checked_after_release,
    check_permit_queued_release_any_token,
    check_permit_release_frees,
    check_permit_renew_after_loss,
    check_permit_retry_keeps_entry,
    check_permit_tokens_increase,
    check_permit_turn_after_release,
    check_permits_within_limit,
    check_rw_fifo,
    check_rw_readers_share,
    check_rw_writer_alone,
    check_semaphore_api,
)

pytestmark = pytest.mark.anyio


class _GrantsPastLimit(MemoryBackend):
    """Grants every request, whatever the permits held."""

    async def try_acquire_permit(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        result = await super().try_acquire_permit(
            name, owner, ttl, identity, metadata, limit, weight
        )
        if isinstance(result, Grant):
            return result
        state = self._permits[name]
        state.queue.pop(owner, None)
        token = self._permit_tokens[name] = self._permit_tokens[name] + 1
        record = _Record(owner, identity, token, dict(metadata), self._clock() + ttl)
        state.held[owner] = (record, weight)
        return Grant(token, ttl)


class _TokensRestart(MemoryBackend):
    """Restarts a name's token counter when its last permit is released."""

    def _release_permit(self, name: str, owner: str, token: int | None) -> bool:
        freed = super()._release_permit(name, owner, token)
        if name not in self._permits:
            self._permit_tokens.pop(name, None)
        return freed


class _TakesAnyLimit(MemoryBackend):
    """Takes the limit of the latest request instead of checking it."""

    async def try_acquire_permit(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        state = self._permits.get(name)
        if state is not None:
            state.limit = limit
        return await super().try_acquire_permit(name, owner, ttl, identity, metadata, limit, weight)


class _HandsOutAnyLimit(MemoryBackend):
    """Serves the next ask of a request that was queued at a release as if it gave
    the name's limit, whatever limit it gives (the SQL backends, before it was fixed:
    a release granted the queue entry, and its next ask took that grant without a
    statement, whatever its limit)."""

    def __init__(self) -> None:
        super().__init__()
        self._handed: set[tuple[str, str]] = set()

    def _release_permit(self, name: str, owner: str, token: int | None) -> bool:
        freed = super()._release_permit(name, owner, token)
        state = self._permits.get(name)
        if state is not None:
            self._handed.update((name, waiter) for waiter in state.queue)
        return freed

    async def try_acquire_permit(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        state = self._permits.get(name)
        if state is not None and (name, owner) in self._handed:
            self._handed.discard((name, owner))
            limit = state.limit
        return await super().try_acquire_permit(name, owner, ttl, identity, metadata, limit, weight)


class _NeverExpires(MemoryBackend):
    """Keeps every permit past its ttl."""

    async def try_acquire_permit(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        result = await super().try_acquire_permit(
            name, owner, ttl, identity, metadata, limit, weight
        )
        if isinstance(result, Grant):
            self._permits[name].held[owner][0].expires_at = math.inf
        return result


class _ReleaseKeeps(MemoryBackend):
    """Says a permit was released, and keeps it."""

    def _release_permit(self, name: str, owner: str, token: int | None) -> bool:
        state = self._live_permits(name)
        held = None if state is None else state.held.get(owner)
        return held is not None and (token is None or held[0].token == token)


class _DequeuesWithoutTokenOnly(MemoryBackend):
    """Drops a queued request's entry only on a release without a token (the MongoDB
    backend's, before it was fixed): one with a token matched granted permits only."""

    def _release_permit(self, name: str, owner: str, token: int | None) -> bool:
        state = self._live_permits(name)
        if token is not None and state is not None and owner not in state.held:
            return False
        return super()._release_permit(name, owner, token)


class _RenewsAnything(MemoryBackend):
    """Renews a permit without looking whether it is held."""

    def _renew_permit(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        return Grant(token, ttl)


class _ReadersAlone(MemoryBackend):
    """Weighs every request as the whole limit: readers exclude each other."""

    async def try_acquire_permit(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        return await super().try_acquire_permit(name, owner, ttl, identity, metadata, limit, limit)


class _NoQueue(MemoryBackend):
    """Forgets the refused requests: a late reader overtakes a waiting writer."""

    async def try_acquire_permit(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        result = await super().try_acquire_permit(
            name, owner, ttl, identity, metadata, limit, weight
        )
        state = self._permits.get(name)
        if state is not None:
            state.queue.clear()
        return result


class _RetryRewritesWeight(MemoryBackend):
    """A refused retry of a queued request rewrites its entry's weight (the Redis
    script's bug: ``HSET`` of the entry on every refusal)."""

    async def try_acquire_permit(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        result = await super().try_acquire_permit(
            name, owner, ttl, identity, metadata, limit, weight
        )
        if isinstance(result, HolderInfo):
            self._permits[name].queue[owner].weight = weight
        return result


class _RetryRequeues(MemoryBackend):
    """A refused retry of a queued request with another weight goes to the back of the
    queue (what ZooKeeper does, which therefore lacks the capability)."""

    async def try_acquire_permit(
        self,
        name: str,
        owner: str,
        ttl: float,
        identity: str,
        metadata: Mapping[str, str],
        limit: int,
        weight: int,
    ) -> Grant | HolderInfo:
        state = self._live_permits(name)
        queued = None if state is None else state.queue.get(owner)
        if state is not None and queued is not None and queued.weight != weight:
            del state.queue[owner]
        return await super().try_acquire_permit(name, owner, ttl, identity, metadata, limit, weight)


class _MissesEarlyRelease(MemoryBackend):
    """Waits out a third of the ttl, whatever went between the refusal and the wait
    (the memory backend's own lost wake-up, before it was fixed)."""

    async def wait_permit_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        await anyio.sleep(ttl / 3)


class _UncheckedPermits(MemoryBackend):
    """Asks the store for permits without the contract's argument checks."""


# Backend wraps every method a subclass defines with the argument checks: undo it.
_UncheckedPermits.try_acquire_permit = MemoryBackend.try_acquire_permit.__wrapped__  # type: ignore[attr-defined,method-assign]


class _ClaimsNoSemaphore(MemoryBackend):
    """Serves permits while it declares that it does not."""

    capabilities = frozenset({Capability.PUSH_WAKEUP, Capability.SERVER_TIME})


MUTANTS: list[tuple[type[MemoryBackend], Check]] = [
    (_GrantsPastLimit, check_permits_within_limit),
    (_GrantsPastLimit, check_rw_writer_alone),
    (_GrantsPastLimit, check_semaphore_api),
    (_TokensRestart, check_permit_tokens_increase),
    (_TakesAnyLimit, check_permit_limit_checked),
    (_HandsOutAnyLimit, check_permit_limit_checked_after_release),
    (_NeverExpires, check_permit_expiry_frees),
    (_ReleaseKeeps, check_permit_release_frees),
    (_DequeuesWithoutTokenOnly, check_permit_queued_release_any_token),
    (_RenewsAnything, check_permit_renew_after_loss),
    (_ReadersAlone, check_rw_readers_share),
    (_NoQueue, check_rw_fifo),
    (_ClaimsNoSemaphore, check_permits_within_limit),
    (_UncheckedPermits, check_permit_bad_arguments_rejected),
    (_MissesEarlyRelease, check_permit_turn_after_release),
    (_RetryRewritesWeight, check_permit_retry_keeps_entry),
    (_RetryRequeues, check_permit_retry_keeps_entry),
]


@pytest.mark.parametrize(
    ("mutant", "check"),
    MUTANTS,
    ids=[f"{m.__name__.strip('_')}-{c.__name__.removeprefix('check_')}" for m, c in MUTANTS],
)
async def test_permit_check_catches_broken_backend(
    mutant: type[MemoryBackend], check: Check
) -> None:
    with pytest.raises(AssertionError):
        await check(mutant)


class _NoPermits(MemoryBackend):
    """A lock backend that does not serve permits: the contract's defaults."""

    capabilities = frozenset({Capability.PUSH_WAKEUP, Capability.SERVER_TIME})
    try_acquire_permit = Backend.try_acquire_permit
    read_permits = Backend.read_permits


@pytest.mark.parametrize("check", [check_permits_within_limit, check_rw_fifo])
async def test_a_backend_without_permits_passes_by_refusing(check: Check) -> None:
    await check(_NoPermits)
    async with _NoPermits() as backend:
        with pytest.raises(aiolease.UnsupportedCapability, match="SEMAPHORE"):
            aiolease.AsyncSemaphore(backend, "n", limit=2, ttl=1)
        with pytest.raises(aiolease.UnsupportedCapability, match="SEMAPHORE"):
            aiolease.AsyncReadWriteLock(backend, "n", ttl=1)


class _RetryRequeuesAndSaysSo(_RetryRequeues):
    """ZooKeeper's behaviour, declared: no :attr:`Capability.PERMIT_RETRY_KEEPS_ENTRY`."""

    capabilities = MemoryBackend.capabilities - {Capability.PERMIT_RETRY_KEEPS_ENTRY}


async def test_a_retry_may_requeue_on_a_backend_that_says_so() -> None:
    await check_permit_retry_keeps_entry(_RetryRequeuesAndSaysSo)
    with pytest.raises(AssertionError, match="lost its place"):
        await check_permit_retry_keeps_entry(_RetryRequeues)
