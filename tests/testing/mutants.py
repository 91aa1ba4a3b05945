"""Broken backends shared by the tests that prove the checks can fail."""

from __future__ import annotations

from aiolease.backends.memory import MemoryBackend


class TokensRestart(MemoryBackend):
    async def release(self, name: str, owner: str, token: int | None) -> bool:
        freed = await super().release(name, owner, token)
        self._tokens.pop(name, None)  # the counter dies with the record
        return freed


class ReleaseByAnyone(MemoryBackend):
    async def release(self, name: str, owner: str, token: int | None) -> bool:
        record = self._live(name)
        return await super().release(name, record.owner if record else owner, None)
