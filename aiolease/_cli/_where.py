"""Where the ``aiolease`` command's leases live: ``--backend``, ``$AIOLEASE_URL``, or a
SQLite file in the user's state directory."""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["ENV_URL", "default_url", "resolve_url", "sqlite_url", "state_dir"]

ENV_URL = "AIOLEASE_URL"


def state_dir() -> Path:
    """The per-user state directory of aiolease (XDG on Linux; platform conventions elsewhere)."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(base) / "aiolease"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "aiolease"
    xdg = os.environ.get("XDG_STATE_HOME", "")
    # The XDG spec says relative paths are invalid and must be ignored.
    base_path = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "state"
    return base_path / "aiolease"


def sqlite_url(path: Path) -> str:
    """The ``sqlite:////absolute/path`` URL of a database file (percent-encoded)."""
    return "sqlite:///" + path.resolve().as_uri().removeprefix("file://")


def default_url() -> str:
    """The embedded default: ``leases.db`` in :func:`state_dir`, created on demand."""
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return sqlite_url(directory / "leases.db")


def resolve_url(given: str | None) -> str:
    """``--backend``, else ``$AIOLEASE_URL``, else :func:`default_url`."""
    return given or os.environ.get(ENV_URL) or default_url()
