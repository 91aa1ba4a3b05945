"""Which backend the harness runs against: a URL, optionally with a backend factory.

A *backend factory* is an import path ``module:attr`` naming either a
:class:`~aiolease.Backend` subclass (opened with its ``from_url(url)``) or an async
callable ``factory(url) -> Backend``. It replaces the class the URL's scheme
would select, in every worker and in the controller, so that a backend defined
outside aiolease (a deliberately broken one, say) can be put through the harness.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from ..._exceptions import InvalidArgument
from ..._registry import _opened, open_backend
from ...abc import Backend

__all__ = ["import_root", "load_factory", "open_target"]


def load_factory(spec: str) -> object:
    """Import ``module:attr``.

    :raises InvalidArgument: malformed, not importable, or neither a Backend class
        nor a callable
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidArgument(f"a backend factory is 'module:attr', got {spec!r}")
    try:
        found: object = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise InvalidArgument(f"backend factory {spec!r} cannot be imported: {exc}") from exc
    if not callable(found):
        raise InvalidArgument(f"backend factory {spec!r} is not a Backend class or a callable")
    return found


def import_root(spec: str) -> str | None:
    """The ``sys.path`` entry from which ``module:attr`` was imported, if it is a file.

    Workers get it on their ``PYTHONPATH``, so that a factory importable in the
    controller (say, from a pytest ``tests`` directory) is importable in them too.
    """
    module_name = spec.partition(":")[0]
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    if file is None:
        return None
    path = Path(file).resolve()
    depth = module_name.count(".") + (2 if path.name == "__init__.py" else 1)
    return str(path.parents[depth - 1])


async def _from_factory(factory: object, url: str) -> Backend:
    if isinstance(factory, type) and issubclass(factory, Backend):
        return await factory.from_url(url)
    made = factory(url) if callable(factory) else None
    backend = await made if inspect.isawaitable(made) else made
    if not isinstance(backend, Backend):
        raise InvalidArgument(f"backend factory {factory!r} returned {backend!r}, not a Backend")
    return backend


@asynccontextmanager
async def open_target(url: str, factory: str | None = None) -> AsyncIterator[Backend]:
    """Open the backend ``url`` names (through ``factory`` if given); close it on exit."""
    if factory is None:
        async with open_backend(url) as backend:
            yield backend
        return
    made = load_factory(factory)
    if isinstance(made, type) and issubclass(made, Backend):
        # Opened as open_backend opens a registered class: bridged under trio.
        async with _opened(made, url, frozenset(), {}) as backend:
            yield backend
        return
    backend = await _from_factory(made, url)
    async with backend:
        yield backend
