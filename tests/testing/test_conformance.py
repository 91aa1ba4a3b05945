"""The conformance suite over every configured backend URL, under asyncio and trio.

The URLs come from ``--aiolease-url`` / ``AIOLEASE_TEST_URLS`` (default: memory and
SQLite); see :mod:`aiolease.testing.pytest_plugin`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import anyio
import pytest

import aiolease
from aiolease import LossReason, NotOwnerError
from aiolease.abc import Backend, Capability, Grant, HolderInfo, Renewal, RenewResult
from aiolease.backends.memory import MemoryBackend, _Record
from aiolease.testing import conformance
from aiolease.testing.conformance import (
    CHECKS,
    LEASE_ONLY,
    BackendFactory,
    Check,
    check_backend,
    check_bad_arguments_rejected,
    check_elector_one_leader,
    check_elector_proclaim,
    check_holder_reported,
    check_idempotent_retry,
    check_lock_acquire_nowait,
    check_lock_cancel_in_flight,
    check_lock_mutual_exclusion,
    check_metadata_round_trip,
    check_names_independent,
    check_release_owner_checked,
    check_release_without_token,
    check_renew_does_not_revive,
    check_renew_many_answers_each,
    check_renew_requires_owner,
    check_renew_resets,
    check_tokens_increase,
    check_update_metadata,
    check_update_metadata_wakes,
    check_wait_changed_on_release,
    check_wait_changed_prompt,
    checks_for,
)
from aiolease.testing.pytest_plugin import ALLOW_SKIP_ENV, URLS_ENV, default_urls
from tests.testing.mutants import ReleaseByAnyone, TokensRestart

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("check", [check for _, check in CHECKS], ids=[n for n, _ in CHECKS])
async def test_conformance(check: Check, aiolease_backend_factory: BackendFactory) -> None:
    await check(aiolease_backend_factory)


# -- the checks catch broken backends ------------------------------------------------


class _RenewAdds(MemoryBackend):
    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        grant = await super().renew(name, owner, token, ttl)
        self._records[name].expires_at += ttl  # extends instead of resetting
        return grant


class _RenewRevives(MemoryBackend):
    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        return Grant(token, ttl)  # never checks the record


class _RenewManyRemembers(MemoryBackend):
    """Keeps its answers to a list of renewals, as if they were derived from the list."""

    async def renew_many(self, renewals: Sequence[Renewal]) -> Sequence[RenewResult]:
        known = getattr(renewals, "cache", {})
        if "answers" not in known:
            known["answers"] = list(await super().renew_many(renewals))
        answers: Sequence[RenewResult] = known["answers"]
        return answers


class _RetryNewToken(MemoryBackend):
    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        record = self._live(name)
        if record is not None and record.owner == owner:
            self.force_release(name)  # a retry becomes a fresh grant
        return await super().try_acquire(name, owner, ttl, identity, metadata)


class _GrantsEveryone(MemoryBackend):
    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        await anyio.lowlevel.checkpoint()
        token = self._tokens[name] = self._tokens.get(name, 0) + 1
        self._records[name] = _Record(owner, identity, token, dict(metadata), self._clock() + ttl)
        return Grant(token, ttl)


class _CaseInsensitive(MemoryBackend):
    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        return await super().try_acquire(name.lower(), owner, ttl, identity, metadata)

    async def read(self, name: str) -> HolderInfo | None:
        return await super().read(name.lower())


class _DropsMetadata(MemoryBackend):
    async def read(self, name: str) -> HolderInfo | None:
        holder = await super().read(name)
        return None if holder is None else dataclasses.replace(holder, metadata={})


class _NoTokenlessRelease(MemoryBackend):
    async def release(self, name: str, owner: str, token: int | None) -> bool:
        return token is not None and await super().release(name, owner, token)


class _SleepsOutTtl(MemoryBackend):
    capabilities = frozenset()

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        # Sleeps out the seen holder's ttl without looking whether it changed.
        await anyio.sleep(seen.remaining if seen and seen.remaining else self.poll_interval)


class _PollingDefault(MemoryBackend):
    capabilities = frozenset()

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        await Backend.wait_changed(self, name, seen)


@pytest.mark.parametrize("check", [check_wait_changed_prompt, check_wait_changed_on_release])
async def test_the_default_wait_changed_conforms(check: Check) -> None:
    await check(_PollingDefault)


class _ProclaimIgnored(MemoryBackend):
    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        await anyio.lowlevel.checkpoint()  # answers as if done, changes nothing


class _ProclaimByAnyone(MemoryBackend):
    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        record = self._live(name)
        if record is not None:  # whoever asks
            await super().update_metadata(name, record.owner, record.token, metadata)


class _ProclaimSilent(MemoryBackend):
    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        await anyio.lowlevel.checkpoint()
        record = self._live(name)
        if record is None or (record.owner, record.token) != (owner, token):
            raise NotOwnerError(name)
        record.metadata = dict(metadata)  # nobody woken


class _ProclaimEndsTerm(MemoryBackend):
    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        await super().update_metadata(name, owner, token, metadata)
        for _, _, taken in list(self._takers.get(name, {}).values()):
            taken(LossReason.STOLEN)  # the announcement taken for a takeover


class _ProclaimRenews(MemoryBackend):
    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        await super().update_metadata(name, owner, token, metadata)
        self._records[name].expires_at = self._clock() + 30.0  # as a retry of the grant would


class _ProclaimUndeclared(MemoryBackend):
    capabilities = MemoryBackend.capabilities - {Capability.PROCLAIM}  # yet it answers


class _ReadsAnyName(MemoryBackend):
    async def read(self, name: str) -> HolderInfo | None:
        record = self._records.get(name)  # any key: a bad name reads as free
        return None if record is None else self._holder(name, record)


class _RenewsAnyTtl(MemoryBackend):
    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        return Grant(token, ttl)  # takes ttl=1e300 (and any name)


# Backend wraps every method a subclass defines with the argument checks: undo it.
for _unchecked, _method in ((_ReadsAnyName, "read"), (_RenewsAnyTtl, "renew")):
    _checked = getattr(_unchecked, _method)
    setattr(_unchecked, _method, getattr(_checked, "__wrapped__", _checked))


MUTANTS: list[tuple[type[MemoryBackend], Check]] = [
    (_RenewAdds, check_renew_resets),
    (_RenewRevives, check_renew_does_not_revive),
    (_RenewRevives, check_renew_requires_owner),
    (_RenewManyRemembers, check_renew_many_answers_each),
    (TokensRestart, check_tokens_increase),
    (ReleaseByAnyone, check_release_owner_checked),
    (_RetryNewToken, check_idempotent_retry),
    (_GrantsEveryone, check_holder_reported),
    (_GrantsEveryone, check_lock_mutual_exclusion),
    (_GrantsEveryone, check_lock_acquire_nowait),
    (_GrantsEveryone, check_elector_one_leader),
    (_CaseInsensitive, check_names_independent),
    (_DropsMetadata, check_metadata_round_trip),
    (_NoTokenlessRelease, check_release_without_token),
    (_NoTokenlessRelease, check_lock_cancel_in_flight),
    (_SleepsOutTtl, check_wait_changed_prompt),
    (_ReadsAnyName, check_bad_arguments_rejected),
    (_RenewsAnyTtl, check_bad_arguments_rejected),
    (_ProclaimIgnored, check_update_metadata),
    (_ProclaimByAnyone, check_update_metadata),
    (_ProclaimUndeclared, check_update_metadata),
    (_ProclaimRenews, check_update_metadata),
    (_ProclaimSilent, check_update_metadata_wakes),
    (_ProclaimEndsTerm, check_elector_proclaim),
]


@pytest.mark.parametrize(
    ("mutant", "check"),
    MUTANTS,
    ids=[f"{m.__name__.strip('_')}-{c.__name__.removeprefix('check_')}" for m, c in MUTANTS],
)
async def test_check_catches_broken_backend(mutant: type[MemoryBackend], check: Check) -> None:
    with pytest.raises(AssertionError):
        await check(mutant)


async def test_check_backend_names_the_failed_check() -> None:
    with pytest.raises(AssertionError, match=r"^renew_resets: "):
        await check_backend(_RenewAdds)


async def test_check_backend_passes_the_reference() -> None:
    await check_backend(MemoryBackend)


class _ElectionOnly(MemoryBackend):
    """The reference, declared election-only: AsyncLock refuses it."""

    capabilities = MemoryBackend.capabilities | {Capability.ELECTION_ONLY}


def test_an_election_only_backend_gets_every_check_but_the_lease_only_ones() -> None:
    every = {name for name, _ in CHECKS}
    assert LEASE_ONLY < every
    assert {name for name, _ in checks_for(_ElectionOnly.capabilities)} == every - LEASE_ONLY
    assert checks_for(MemoryBackend.capabilities) == CHECKS


async def test_check_backend_runs_what_applies_to_an_election_only_backend() -> None:
    """The lock checks would fail on it (AsyncLock refuses it): they are not run."""
    await check_backend(_ElectionOnly)
    async with _ElectionOnly() as backend:
        with pytest.raises(aiolease.UnsupportedCapability, match="ELECTION_ONLY"):
            aiolease.AsyncLock(backend, "n", ttl=1)
        async with aiolease.Elector(backend, "n", ttl=1).leadership() as lease:
            assert lease.token == 1


def test_checks_are_unique_and_public() -> None:
    names = [name for name, _ in CHECKS]
    assert len(names) == len(set(names))
    for name, check in CHECKS:
        assert getattr(conformance, f"check_{name}") is check
        assert f"check_{name}" in conformance.__all__


# -- the pytest plugin -----------------------------------------------------------------

pytest_plugins = ["pytester"]

_USES_BACKEND = """
import pytest

@pytest.fixture
def anyio_backend():
    return "asyncio"

@pytest.mark.anyio
async def test_uses_backend(aiolease_backend):
    assert await aiolease_backend.read("x") is None

def test_url(aiolease_url):
    assert "{tmp}" not in aiolease_url
"""


def test_plugin_defaults_to_memory_and_sqlite_if_present(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(URLS_ENV, raising=False)
    pytester.makepyfile(_USES_BACKEND)
    result = pytester.runpytest("-v", "-p", "no:cacheprovider")
    schemes = [url.partition(":")[0] for url in default_urls()]
    assert schemes[0] == "memory"
    result.assert_outcomes(passed=2 * len(schemes))
    result.stdout.fnmatch_lines([f"*test_url[[]{scheme}[]]*" for scheme in schemes])


def test_plugin_takes_urls_from_option_then_env(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(_USES_BACKEND)
    monkeypatch.setenv(URLS_ENV, "memory://, memory://")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=4)
    option = pytester.runpytest("-p", "no:cacheprovider", "--aiolease-url", "memory://")
    option.assert_outcomes(passed=2)


@pytest.mark.parametrize("allow_skip", [False, True])
def test_plugin_fails_unreachable_backend_unless_allowed(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, allow_skip: bool
) -> None:
    monkeypatch.delenv("CI", raising=False)  # in CI the opt-out is ignored (test_servers)
    if allow_skip:
        monkeypatch.setenv(ALLOW_SKIP_ENV, "1")
    else:
        monkeypatch.delenv(ALLOW_SKIP_ENV, raising=False)
    pytester.makepyfile(_USES_BACKEND)
    # No backend is registered for this scheme: like a server that is not there.
    result = pytester.runpytest("-p", "no:cacheprovider", "--aiolease-url", "nosuch://host")
    if allow_skip:
        result.assert_outcomes(passed=1, skipped=1)
    else:
        result.assert_outcomes(passed=1, errors=1)
