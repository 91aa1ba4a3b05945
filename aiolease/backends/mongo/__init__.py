"""The MongoDB backend (pymongo's asyncio client): one atomic upsert judged on the
server's clock, durable fencing tokens, change-stream wake-ups, a fair queue.

See :mod:`aiolease.backends.mongo._backend` and ``docs/backends/mongo.md``.
"""

from ._backend import MongoBackend, MongoStatistics

__all__ = ["MongoBackend", "MongoStatistics"]
