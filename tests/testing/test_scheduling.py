"""The suite's xdist scheduling (tests/conftest.py): a worker that dies mid-run is
replaced, and the run still ends."""

from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

_CONFTEST = """
from typing import Any

from tests.conftest import ServerGroupScheduling


def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    return ServerGroupScheduling(config, log)
"""

_TESTS = """
import os


def test_0() -> None:
    pass


def test_1() -> None:
    pass


def test_2() -> None:
    pass


def test_3() -> None:
    pass


def test_4() -> None:
    pass


def test_5_the_worker_dies() -> None:
    os._exit(1)  # as a worker killed by pytest-timeout's "thread" method does
"""


def test_a_run_whose_worker_died_in_its_last_test_ends(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dead worker had finished tests before: xdist's own scheduler put those back
    in the queue, its replacement was handed one with nothing left to run, and the run
    waited forever (here: until the subprocess's timeout)."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeconftest(_CONFTEST)
    pytester.makepyfile(_TESTS)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-n", "2", "-p", "no:randomly", timeout=60
    )
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines(["*crashed while running*test_5_the_worker_dies*"])
