"""The examples of docs/examples/, loaded by path (docs/ is not a package), and the apps
the uvicorn processes of the tests serve (``uvicorn tests.integrations.examples:... --factory``)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio

from aiolease import Lease
from aiolease.integrations.fastapi import Leases

ROOT = Path(__file__).resolve().parents[2]
#: The backend URL of the app a uvicorn process of the tests serves.
URL_ENV = "AIOLEASE_TEST_APP_URL"
#: The ttl of the examples' leases in the tests: short, so a failover is quick.
TTL = 2.0


def example(name: str) -> ModuleType:
    """``docs/examples/<name>.py``, imported once."""
    key = f"aiolease_example_{name}"
    module = sys.modules.get(key)
    if module is None:
        spec = importlib.util.spec_from_file_location(
            key, ROOT / "docs" / "examples" / f"{name}.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return module


def _example_app() -> Any:
    return example("fastapi_app").create_app(os.environ[URL_ENV], ttl=TTL)


def fastapi_app() -> Any:
    """The FastAPI example as it is."""
    return _example_app()


def crashing_fastapi_app() -> Any:
    """The FastAPI example with a second leader job that crashes in its first two terms."""
    app = _example_app()
    leases: Leases = app.state.leases
    terms = 0

    @leases.leader_job("flaky", ttl=TTL)
    async def flaky(lease: Lease) -> None:
        nonlocal terms
        terms += 1
        if terms <= 2:
            raise RuntimeError(f"flaky crashes in term {terms}")
        await anyio.sleep_forever()

    return app


def exiting_fastapi_app() -> Any:
    """The FastAPI example with a leader job that crashes, with ``on_crash="exit"``."""
    app = _example_app()
    leases: Leases = app.state.leases

    @leases.leader_job("doomed", ttl=TTL, on_crash="exit")
    async def doomed(lease: Lease) -> None:
        raise RuntimeError("doomed crashes")

    return app
