"""Every public name of a public module is in its ``__all__``, and nothing else is."""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import types
from pathlib import Path

import pytest

import aiolease

#: The public modules of the core, the testing tools and the single-module backends
#: (the backend packages of other families check their own).
PUBLIC_MODULES = [
    "aiolease",
    "aiolease.abc",
    "aiolease.cli",
    "aiolease.integrations.otel",
    "aiolease.testing",
    "aiolease.testing.asyncio_only",
    "aiolease.testing.conformance",
    "aiolease.testing.etcd_cluster",
    "aiolease.testing.faults",
    "aiolease.testing.memory",
    "aiolease.testing.model",
    "aiolease.testing.proxy",
    "aiolease.testing.pytest_plugin",
    "aiolease.testing.remote",
    "aiolease.testing.safety",
    "aiolease.testing.servers",
    "aiolease.backends.memory",
    "aiolease.backends.sqlite",
    "aiolease.backends.etcd",
    "aiolease.integrations",
    "aiolease.integrations.aiohttp",
    "aiolease.integrations.fastapi",
]


def _explicit_reexports(module: types.ModuleType) -> set[str]:
    """Names the module's source binds with ``from x import y as y`` (a re-export)."""
    source = inspect.getsource(module)
    return {
        alias.asname
        for node in ast.parse(source).body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname is not None and alias.asname == alias.name
    }


def _public_names(module: types.ModuleType) -> set[str]:
    """What ``module`` offers: the classes and functions defined in it, and whatever
    it re-exports (``from x import y as y``); never a submodule or a private name."""
    names = _explicit_reexports(module)
    for name, value in vars(module).items():
        if inspect.isclass(value) or inspect.isfunction(value):
            if value.__module__ == module.__name__:
                names.add(name)
    return {
        name
        for name in names
        if not name.startswith(("_", "pytest_"))  # a plugin's hooks are pytest's to call
        and not isinstance(getattr(module, name), types.ModuleType)
    }


def missing_from_all(module: types.ModuleType) -> set[str]:
    """The public names of ``module`` that its ``__all__`` leaves out."""
    return _public_names(module) - set(getattr(module, "__all__", ()))


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_public_name_is_in_all(name: str) -> None:
    module = importlib.import_module(name)
    assert isinstance(module.__all__, list)
    assert sorted(module.__all__) == sorted(set(module.__all__)), "a name listed twice"
    assert not missing_from_all(module)
    for exported in module.__all__:
        assert hasattr(module, exported), f"{name}.__all__ names {exported!r}, which is not there"


def test_the_package_exports_only_its_own_objects() -> None:
    for name in aiolease.__all__:
        assert getattr(aiolease, name).__module__.startswith("aiolease")


def test_a_public_name_left_out_of_all_is_caught(tmp_path: Path) -> None:
    """The check is not vacuous: a module that re-exports or defines a public name
    without listing it fails."""
    source = (
        "from aiolease import AsyncLock as AsyncLock\n"
        "from aiolease import Lease as Lease\n"
        "def helper() -> None: ...\n"
        "def _private() -> None: ...\n"
        "__all__ = ['AsyncLock']\n"
    )
    (tmp_path / "aiolease_fake_public.py").write_text(source)
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module("aiolease_fake_public")
        assert missing_from_all(module) == {"Lease", "helper"}
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("aiolease_fake_public", None)
