"""pytest plugin: run tests against every backend URL you name.

Options::

    pytest --aiolease-url redis://127.0.0.1:6379/0 --aiolease-url memory://
    AIOLEASE_TEST_URLS="postgresql://localhost/test,etcd://localhost:2379" pytest

Without either, the URLs are ``memory://`` and, when :mod:`aiolease.backends.sqlite`
imports, a SQLite file in a temporary directory. ``{tmp}`` in a URL is replaced by
a per-session temporary directory.

Fixtures (the async ones need anyio's ``anyio_backend`` fixture, as any anyio test):

* ``aiolease_url``: parametrised over the URLs (ids are the schemes)
* ``aiolease_backend``: an open backend for the URL
* ``aiolease_backend_factory``: opens a fresh backend per call, for
  :mod:`aiolease.testing.conformance`
* ``aiolease_server``: a function that takes a service name of
  :data:`aiolease.testing.servers.SERVERS` (``"redis"``, ``"etcd-cluster"``, ...) and
  returns its URL once every address in it accepts connections

trio-asyncio (which patches asyncio when imported) is imported before the first test
only when a collected test runs under trio: a session of asyncio tests never loads it.

A backend or server that cannot be reached **fails** the test: in CI (``CI=true``)
a missing server must never pass silently. Only a developer who opts out locally
with ``AIOLEASE_ALLOW_SKIP=1`` (and not in CI) gets a skip, with the reason.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
import warnings
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, NoReturn

import pytest

from .._exceptions import BackendError, BackendNotFound, InvalidArgument
from .._registry import open_backend, scheme_of
from .._urls import redact
from ..abc import Backend
from . import servers
from ._support import BackendFactory

__all__ = [
    "ALLOW_SKIP_ENV",
    "URLS_ENV",
    "aiolease_backend",
    "aiolease_backend_factory",
    "aiolease_server",
    "aiolease_url",
    "default_urls",
    "server_missing",
]

#: Comma-separated backend URLs to test when ``--aiolease-url`` is not given.
URLS_ENV = "AIOLEASE_TEST_URLS"
#: Set to ``1`` to skip, not fail, tests whose backend cannot be reached (never in CI).
ALLOW_SKIP_ENV = servers.ALLOW_SKIP_ENV
#: Placeholder for the session's temporary directory in a URL.
TMP = "{tmp}"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("aiolease")
    group.addoption(
        "--aiolease-url",
        action="append",
        default=[],
        metavar="URL",
        help=f"backend URL to run aiolease backend tests against (repeatable; else ${URLS_ENV})",
    )


def _runs_under_trio(item: pytest.Item) -> bool:
    """Whether ``item`` is a test that runs under trio (anyio's ``anyio_backend``
    parameter naming trio, or pytest-trio's ``trio`` mark)."""
    callspec = getattr(item, "callspec", None)
    backend: Any = None if callspec is None else callspec.params.get("anyio_backend")
    if isinstance(backend, tuple | list) and backend:
        backend = backend[0]
    return backend == "trio" or item.get_closest_marker("trio") is not None


def _import_trio_asyncio() -> None:
    """Import trio-asyncio, if it is installed, before any test runs.

    trio-asyncio patches asyncio's running-loop lookups when it is imported. anyio's
    asyncio backend binds them when *it* is first imported, so in a test session that
    runs both loops, trio-asyncio must come first, or anyio calls made inside a
    bridged asyncio-only backend fail under trio with "no running event loop".
    """
    try:
        with warnings.catch_warnings():
            # trio-asyncio (0.16) subclasses asyncio.AbstractChildWatcher, deprecated on
            # Python 3.12+: a warnings-as-errors run would fail here.
            warnings.filterwarnings(
                "ignore", "'AbstractChildWatcher' is deprecated", DeprecationWarning
            )
            import trio_asyncio  # noqa: F401
    except ImportError:  # pragma: no cover - the [trio] extra is not installed
        return
    _rebind_anyio_running_loop()


def _rebind_anyio_running_loop() -> None:
    """Point anyio's asyncio backend at trio-asyncio's ``get_running_loop``.

    anyio's pytest plugin imports its backends while tests are collected, before the
    items (and so whether any runs under trio) are known; anyio's asyncio backend then
    holds the ``get_running_loop`` that trio-asyncio had not patched yet. Its one such
    binding is pointed at the patched lookup, as if it had been imported after.
    """
    backend = sys.modules.get("anyio._backends._asyncio")
    if backend is not None and getattr(backend, "get_running_loop", None) is not None:
        setattr(backend, "get_running_loop", asyncio.get_running_loop)  # noqa: B010


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Import trio-asyncio only when a collected test runs under trio: it patches
    asyncio, which a session of asyncio tests alone (every downstream project that
    installs aiolease) must not get."""
    if any(_runs_under_trio(item) for item in items):
        _import_trio_asyncio()


def _sqlite_available() -> bool:
    try:
        importlib.import_module("aiolease.backends.sqlite")
    except ImportError:
        return False
    return True


def default_urls() -> list[str]:
    """``memory://``, plus a SQLite file in the session's temporary directory if it imports."""
    urls = ["memory://"]
    if _sqlite_available():
        urls.append(f"sqlite:///{TMP}/leases.db")
    return urls


def _configured_urls(config: pytest.Config) -> list[str]:
    """The URLs from ``--aiolease-url``, else ``$AIOLEASE_TEST_URLS``, else the defaults."""
    urls: list[str] = list(config.getoption("aiolease_url") or [])
    if not urls:
        urls = [url.strip() for url in os.environ.get(URLS_ENV, "").split(",") if url.strip()]
    return urls or default_urls()


def _url_id(url: str) -> str:
    try:
        return scheme_of(url)
    except InvalidArgument:
        return redact(url)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "aiolease_url" in metafunc.fixturenames:
        urls = _configured_urls(metafunc.config)
        metafunc.parametrize("aiolease_url", urls, ids=[_url_id(u) for u in urls], indirect=True)


@pytest.fixture(scope="session")
def _aiolease_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aiolease")


@pytest.fixture
def aiolease_url(request: pytest.FixtureRequest, _aiolease_tmp: Path) -> str:
    """One backend URL under test (``{tmp}`` replaced by a session temporary directory)."""
    url = str(request.param)
    return url.replace(TMP, _aiolease_tmp.as_posix())


def server_missing(why: str) -> NoReturn:
    """Fail the test because a server it needs is missing, or skip it when the
    developer opted out locally (``AIOLEASE_ALLOW_SKIP=1``, never in CI)."""
    if servers.allow_skip():
        pytest.skip(f"{why} ({ALLOW_SKIP_ENV}=1)")
    pytest.fail(why, pytrace=False)


def _unreachable(what: str, exc: BaseException) -> None:
    """Skip when the developer allows it; otherwise let the error fail the test."""
    if servers.allow_skip():
        pytest.skip(f"{what} unavailable ({exc}) and {ALLOW_SKIP_ENV}=1")


@pytest.fixture
def aiolease_server() -> Callable[[str], str]:
    """``aiolease_server("redis")`` -> the URL of that test server, checked reachable.

    An unreachable server fails the test (always in CI), or skips it when the
    developer opted out locally with ``AIOLEASE_ALLOW_SKIP=1``.
    """

    def get(name: str) -> str:
        srv = servers.server(name)
        try:
            srv.check()
        except servers.ServerUnreachable as exc:
            problem = exc
        else:
            return srv.url
        server_missing(str(problem))

    return get


@pytest.fixture
async def aiolease_backend(aiolease_url: str, anyio_backend: object) -> AsyncIterator[Backend]:
    """An open backend for :func:`aiolease_url`, closed after the test."""
    async with AsyncExitStack() as stack:
        try:
            backend = await stack.enter_async_context(open_backend(aiolease_url))
        except (BackendError, BackendNotFound) as exc:
            _unreachable(f"backend {redact(aiolease_url)!r}", exc)
            raise
        yield backend


@pytest.fixture
async def aiolease_backend_factory(
    aiolease_url: str, anyio_backend: object
) -> AsyncIterator[BackendFactory]:
    """Opens a fresh backend for :func:`aiolease_url` on each call.

    The backend is opened once up front, so an unreachable server is reported here.
    """
    try:
        async with open_backend(aiolease_url):
            pass
    except (BackendError, BackendNotFound) as exc:
        _unreachable(f"backend {redact(aiolease_url)!r}", exc)
        raise
    yield lambda: open_backend(aiolease_url)
