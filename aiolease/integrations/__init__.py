"""Integrations with other libraries: :mod:`aiolease.integrations.fastapi` (FastAPI and
Starlette, extra ``[fastapi]``), :mod:`aiolease.integrations.aiohttp` (extra
``[aiohttp]``) and :mod:`aiolease.integrations.otel` (OpenTelemetry, extra ``[otel]``).
Each module imports its library when it is imported itself; this package imports none."""

__all__: list[str] = []
