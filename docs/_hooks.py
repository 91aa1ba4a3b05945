"""mkdocs hooks: the capability matrix on the Backends page is built from the code.

Each backend declares ``capabilities`` as a class attribute; rendering the table
from those attributes means the docs cannot drift from what the code promises.
"""

from __future__ import annotations

import importlib
from typing import Any

from aiolease.abc import Backend, Capability

MARKER = "<!-- capability-matrix -->"

#: The backends shipped today, in the order the matrix lists them.
BACKENDS = {
    "memory": "aiolease.backends.memory:MemoryBackend",
    "SQLite": "aiolease.backends.sqlite:SQLiteBackend",
    "Redis": "aiolease.backends.redis:RedisBackend",
    "Redlock": "aiolease.backends.redlock:RedlockBackend",
    "PostgreSQL": "aiolease.backends.postgres:PostgresBackend",
    "MySQL": "aiolease.backends.mysql:MySQLBackend",
    "etcd": "aiolease.backends.etcd:EtcdBackend",
}


def load(target: str) -> type[Backend]:
    """Import ``module:Class``.

    :param target: where the backend class lives
    :raises TypeError: the target is not a backend class
    """
    module_name, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"{target} is not an aiolease Backend")
    return cls


def capability_matrix() -> str:
    """A Markdown table: one row per capability, one column per backend."""
    classes = {label: load(target) for label, target in BACKENDS.items()}
    header = "| capability | " + " | ".join(classes) + " |"
    rule = "|---|" + "---|" * len(classes)
    rows = [
        f"| `{cap.name}` | "
        + " | ".join("yes" if cap in cls.capabilities else "no" for cls in classes.values())
        + " |"
        for cap in Capability
    ]
    bridged = " | ".join("yes" if cls.requires_asyncio else "no" for cls in classes.values())
    rows.append(f"| needs asyncio (bridged under trio) | {bridged} |")
    return "\n".join([header, rule, *rows])


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace the marker with the generated matrix.

    :param markdown: the page's Markdown source
    :param kwargs: the page, config and files mkdocs passes
    """
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, capability_matrix())
