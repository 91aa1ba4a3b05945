"""Identifiers, owner ids and metadata as the SQL backends store them."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from ..._exceptions import InvalidArgument

__all__ = ["IDENTIFIER_RE", "MAX_OWNER_BYTES", "check_identifier", "check_owner", "encode_metadata"]

#: A plain SQL identifier: ASCII letter or ``_`` first, then letters, digits and ``_``;
#: at most 63 characters (PostgreSQL's limit; MySQL allows 64).
IDENTIFIER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
#: The most UTF-8 bytes of an owner id (the core makes 32-character hex ids).
MAX_OWNER_BYTES = 255


def check_identifier(what: str, value: object) -> str:
    """Validate a table, schema or channel name; it is quoted as well wherever it is used.

    :raises InvalidArgument: unless all of ``value`` matches :data:`IDENTIFIER_RE`
    """
    if not isinstance(value, str) or not IDENTIFIER_RE.fullmatch(value):
        raise InvalidArgument(
            f"{what} must be a plain SQL identifier matching {IDENTIFIER_RE.pattern} "
            f"(ASCII letters, digits, _), got {value!r}"
        )
    return value


def check_owner(owner: str) -> bytes:
    """The owner id as UTF-8 bytes.

    :raises InvalidArgument: the owner is empty, contains NUL or exceeds 255 bytes
    """
    raw = owner.encode("utf-8")
    if not raw or b"\x00" in raw or len(raw) > MAX_OWNER_BYTES:
        raise InvalidArgument(f"owner id must be 1-{MAX_OWNER_BYTES} bytes without NUL")
    return raw


def encode_metadata(metadata: Mapping[str, str]) -> str:
    """Metadata as the JSON text stored in the row (keys sorted, unicode kept)."""
    return json.dumps(dict(metadata), ensure_ascii=False, sort_keys=True)
