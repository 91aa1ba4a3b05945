"""pytest plugin: run tests against every backend URL you name.

Options::

    pytest --aiolease-url redis://127.0.0.1:6379/0 --aiolease-url memory://
    AIOLEASE_TEST_URLS="postgresql://localhost/test,etcd://localhost:2379" pytest

Without either, the URLs are ``memory://`` and, when :mod:`aiolease.backends.sqlite`
imports, a SQLite file in a temporary directory. ``{tmp}`` in a URL is replaced by
a per-session temporary directory.

Fixtures:

* ``aiolease_url``: parametrised over the URLs (ids are the schemes)
* ``aiolease_backend``: an open backend for the URL
* ``aiolease_backend_factory``: opens a fresh backend per call, for
  :mod:`aiolease.testing.conformance`
* ``aiolease_driven_backend``: a fresh :class:`~aiolease.testing.memory.DrivenMemoryBackend`

``aiolease_backend`` and ``aiolease_backend_factory`` open their backend on the event
loop that runs the test: anyio's (a test that uses ``anyio_backend``, as any anyio
test does), or pytest-asyncio's, in the test's loop scope (a test with its
``asyncio`` mark, which its auto mode adds), so that the backend's renewals run
while the test does.
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
from .memory import DrivenMemoryBackend

__all__ = [
    "ALLOW_SKIP_ENV",
    "URLS_ENV",
    "aiolease_backend",
    "aiolease_backend_factory",
    "aiolease_driven_backend",
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
def aiolease_backend(request: pytest.FixtureRequest, aiolease_url: str) -> Backend:
    """An open backend for :func:`aiolease_url`, closed after the test: opened on the
    event loop the test runs on (anyio's, or pytest-asyncio's in its loop scope)."""
    backend: Backend = request.getfixturevalue(_on_the_tests_loop(request, "backend"))
    return backend


@pytest.fixture
def aiolease_backend_factory(request: pytest.FixtureRequest, aiolease_url: str) -> BackendFactory:
    """Opens a fresh backend for :func:`aiolease_url` on each call.

    The backend is opened once up front (on the test's event loop, as for
    :func:`aiolease_backend`), so an unreachable server is reported here.
    """
    factory: BackendFactory = request.getfixturevalue(_on_the_tests_loop(request, "factory"))
    return factory


@pytest.fixture
def aiolease_driven_backend() -> DrivenMemoryBackend:
    """A fresh :class:`~aiolease.testing.memory.DrivenMemoryBackend` (no event loop needed
    to make one: any test, of any plugin, may use it)."""
    return DrivenMemoryBackend()


#: pytest-asyncio's loop scopes: each async fixture is made once per scope, so that it
#: runs on the loop of the test that asks for it.
_LOOP_SCOPES = ("function", "class", "module", "package", "session")


def _on_the_tests_loop(request: pytest.FixtureRequest, what: str) -> str:
    """The name of the fixture that makes ``what`` on the event loop of the test.

    An anyio test (it uses ``anyio_backend``) gets anyio's; a pytest-asyncio test (its
    ``asyncio`` mark, which pytest-asyncio's auto mode adds too) gets the one of its
    loop scope, which pytest-asyncio runs on that loop. Anything else gets anyio's.
    """
    if "anyio_backend" not in request.fixturenames and request.config.pluginmanager.has_plugin(
        "asyncio"
    ):
        marker = request.node.get_closest_marker("asyncio")
        if marker is not None:
            scope = (
                marker.kwargs.get("loop_scope")
                or marker.kwargs.get("scope")
                or request.config.getini("asyncio_default_test_loop_scope")
                or "function"
            )
            return f"_aiolease_{what}_asyncio_{scope}"
    return f"_aiolease_{what}_anyio"


async def _open(url: str) -> AsyncIterator[Backend]:
    async with AsyncExitStack() as stack:
        try:
            backend = await stack.enter_async_context(open_backend(url))
        except (BackendError, BackendNotFound) as exc:
            _unreachable(f"backend {redact(url)!r}", exc)
            raise
        yield backend


async def _factory(url: str) -> AsyncIterator[BackendFactory]:
    try:
        async with open_backend(url):
            pass
    except (BackendError, BackendNotFound) as exc:
        _unreachable(f"backend {redact(url)!r}", exc)
        raise
    yield lambda: open_backend(url)


@pytest.fixture
async def _aiolease_backend_anyio(
    aiolease_url: str, anyio_backend: object
) -> AsyncIterator[Backend]:
    async for backend in _open(aiolease_url):
        yield backend


@pytest.fixture
async def _aiolease_factory_anyio(
    aiolease_url: str, anyio_backend: object
) -> AsyncIterator[BackendFactory]:
    async for factory in _factory(aiolease_url):
        yield factory


def _asyncio_fixtures() -> dict[str, object]:
    """The fixtures of :func:`_on_the_tests_loop` for pytest-asyncio's tests, one per
    loop scope (none if pytest-asyncio is not installed)."""
    try:
        pytest_asyncio = importlib.import_module("pytest_asyncio")
    except ImportError:
        return {}
    fixtures: dict[str, object] = {}
    for scope in _LOOP_SCOPES:

        async def backend(aiolease_url: str) -> AsyncIterator[Backend]:
            async for opened in _open(aiolease_url):
                yield opened

        async def factory(aiolease_url: str) -> AsyncIterator[BackendFactory]:
            async for made in _factory(aiolease_url):
                yield made

        for what, fn in (("backend", backend), ("factory", factory)):
            name = f"_aiolease_{what}_asyncio_{scope}"
            fixtures[name] = pytest_asyncio.fixture(fn, loop_scope=scope, name=name)
    return fixtures


globals().update(_asyncio_fixtures())
