"""Integrations with web frameworks: :mod:`aiolease.integrations.fastapi` (FastAPI and
Starlette, extra ``[fastapi]``) and :mod:`aiolease.integrations.aiohttp` (extra
``[aiohttp]``). Each module imports its framework when it is imported itself; this
package imports none."""

__all__: list[str] = []
