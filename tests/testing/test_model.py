"""The stateful model test: each configured backend against the memory model.

Runs under asyncio and trio (the event loop of the machine's blocking portal).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis.stateful import run_state_machine_as_test

import aiolease
from aiolease import NotOwnerError
from aiolease._permits import RW_LIMIT
from aiolease.abc import Grant, HolderInfo
from aiolease.backends.memory import MemoryBackend
from aiolease.testing.model import make_model_machine
from tests.testing.mutants import ReleaseByAnyone, TokensRestart
from tests.testing.test_permit_checks import _GrantsPastLimit, _NoQueue, _TakesAnyLimit

SETTINGS = settings(
    max_examples=30,
    stateful_step_count=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
#: Quiet and quick: only whether the machine notices matters here.
MUTANT_SETTINGS = settings(
    SETTINGS,
    max_examples=100,
    phases=[Phase.generate],
    report_multiple_bugs=False,
    verbosity=Verbosity.quiet,
)


def test_backend_agrees_with_model(aiolease_url: str) -> None:
    # The loops take turns across the in-process backends (memory: asyncio; SQLite and
    # any other: trio), as the servers' model tests pair them with their deployments:
    # each backend meets the model once, and each loop meets it (docs/testing.md).
    loop = "asyncio" if aiolease_url.startswith("memory:") else "trio"
    # The SQL backends' release grants the queued permit requests that then fit.
    grants = aiolease_url.startswith(("sqlite", "postgres", "mysql", "mariadb"))
    machine = make_model_machine(
        lambda: aiolease.open_backend(aiolease_url), anyio_backend=loop, grants_on_release=grants
    )
    run_state_machine_as_test(machine, settings=SETTINGS)


def test_a_release_that_removes_nothing_grants_nothing(tmp_path: Path) -> None:
    # A queued reader fits once the writer queued ahead of it was granted as a reader
    # (a retry with weight 1): it stays queued until it asks again, on the model as on
    # SQLite, and a release that removes nothing (by an owner that neither holds nor
    # queues) grants nothing. The machine had the model's waiters ask again after
    # every release, and failed SQLite for not granting the reader there.
    url = f"sqlite:///{tmp_path}/leases.db"
    machine = make_model_machine(lambda: aiolease.open_backend(url), grants_on_release=True)()
    try:
        reader, writer = ("/rw", RW_LIMIT, 1), ("/rw", RW_LIMIT, RW_LIMIT)
        machine.try_acquire_permit(request=reader, owner="permit:a")  # granted
        machine.try_acquire_permit(request=writer, owner="permit:b")  # queued
        machine.try_acquire_permit(request=reader, owner="permit:c")  # queued behind it
        machine.try_acquire_permit(request=reader, owner="permit:b")  # granted, weight 1
        machine.release_permit(suffix="/rw", owner="permit:d", with_token=False)
        machine.read_permits(suffix="/rw")
        machine.release_permit(suffix="/rw", owner="permit:a", with_token=True)  # grants c
        machine.read_permits(suffix="/rw")
    finally:
        machine.teardown()


# -- the machine catches broken backends -----------------------------------------------


class _RenewRevives(MemoryBackend):
    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        try:
            return await super().renew(name, owner, token, ttl)
        except NotOwnerError:
            return Grant(token, ttl)  # as if renewing a record that is gone


class _ForgetsMetadata(MemoryBackend):
    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        return await super().try_acquire(name, owner, ttl, identity, {})


@pytest.mark.parametrize(
    "mutant",
    [
        TokensRestart,
        ReleaseByAnyone,
        _RenewRevives,
        _ForgetsMetadata,
        _GrantsPastLimit,
        _NoQueue,
        _TakesAnyLimit,
    ],
    ids=lambda m: m.__name__.strip("_"),
)
def test_model_catches_broken_backend(mutant: type[MemoryBackend]) -> None:
    machine = make_model_machine(mutant, anyio_backend="asyncio")
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=MUTANT_SETTINGS)
