"""What the backends compare about holders: one helper, shared by every backend package.

(:mod:`aiolease.abc`'s default ``wait_changed`` compares holders the same way, with a
copy of its own; once the contract's value types have left ``abc``, this belongs
beside :class:`~aiolease.abc.HolderInfo`.)
"""

from __future__ import annotations

from ..abc import HolderInfo

__all__ = ["identity_of"]


def identity_of(holder: HolderInfo | None) -> tuple[str, int] | None:
    """What tells one holding of a name from another: its owner and fencing token
    (``None``: nobody holds it). A renewal changes neither; any grant changes the token.
    """
    return None if holder is None else (holder.owner, holder.token)
