"""What ``open_backend`` says about a scheme it cannot serve: an install hint only
for an extra that exists, and "planned" for a backend that is not written yet."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import aiolease
from aiolease import _registry

pytestmark = pytest.mark.anyio

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def declared_extras() -> set[str]:
    """The extras that pyproject.toml declares (read as text: no tomllib on 3.10)."""
    text = PYPROJECT.read_text(encoding="utf-8")
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([A-Za-z0-9_-]+)\s*=", section, flags=re.MULTILINE))


async def test_a_planned_backend_is_said_to_be_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every backend named in the design is written now: a made-up planned one.
    monkeypatch.setitem(_registry.PLANNED, "consul", "Consul")
    url, label = "consul://127.0.0.1:8500", "Consul"
    with pytest.raises(aiolease.BackendNotFound) as info:
        async with aiolease.open_backend(url):
            pass  # pragma: no cover
    message = str(info.value)
    assert f"the {label} backend is planned but not written yet" in message
    assert "pip install" not in message


def test_every_install_hint_names_a_declared_extra() -> None:
    extras = declared_extras()
    assert {"redis", "postgres", "mysql", "etcd", "mongo", "kafka", "zookeeper"} <= extras
    missing = {scheme: extra for scheme, extra in _registry.EXTRAS.items() if extra not in extras}
    assert not missing, f"install hints name extras that pyproject.toml lacks: {missing}"


def test_a_planned_scheme_has_neither_a_backend_nor_an_extra() -> None:
    for scheme in _registry.PLANNED:
        assert scheme not in _registry.BUILTIN
        assert scheme not in _registry.EXTRAS


def test_a_missing_driver_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # As if the redis extra were not installed: its backend module cannot be imported.
    monkeypatch.setattr(_registry, "entry_points", lambda group: [])
    monkeypatch.setitem(_registry.BUILTIN, "redis", "aiolease_no_such_driver:Backend")
    with pytest.raises(aiolease.BackendNotFound, match=r"pip install 'aiolease\[redis\]'"):
        _registry.backend_class("redis")
