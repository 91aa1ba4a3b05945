"""Reading the scripts' and the server's replies: the holder of a lease, text, config.

Shared by the Redis and the Redlock backends (whose READ and refused ACQUIRE replies
have the same shape).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..._exceptions import ForeignDataError
from ...abc import HolderInfo

__all__ = ["config_pairs", "holder_from", "text"]


def text(value: object) -> str:
    """A string reply (bytes from a client without ``decode_responses``) as text.

    :raises TypeError: not a string reply
    """
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, str):
        return value
    raise TypeError(f"expected a string reply, got {value!r}")


def holder_from(name: str, reply: Sequence[Any], place: str | None = None) -> HolderInfo:
    """A READ or refused ACQUIRE reply ``{0, owner, identity, token, metadata, pttl}``.

    :param place: where the lease is, as the error names it (default: the lease of name)
    :raises ForeignDataError: the metadata is not a JSON map of strings
    """
    _, owner, identity, token, metadata, pttl = reply
    try:
        meta = {} if metadata == b"{}" else json.loads(text(metadata))
        if not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
        ):
            raise ValueError("not a map of strings")
    except (ValueError, TypeError) as exc:
        raise ForeignDataError(
            f"{place or f'the lease of {name!r}'} holds metadata aiolease did not write"
            f" ({exc}); it was left unchanged",
            name=name,
        ) from exc
    return HolderInfo(name, text(owner), text(identity), int(token), meta, int(pttl) / 1000)


def config_pairs(reply: object) -> dict[str, str]:
    """``CONFIG GET``'s reply (a dict from redis-py, or a flat list) as text pairs."""
    if isinstance(reply, Mapping):
        items = list(reply.items())
    elif isinstance(reply, (list, tuple)):
        items = list(zip(reply[::2], reply[1::2], strict=True))
    else:
        return {}
    return {text(k).lower(): text(v).lower() for k, v in items}
