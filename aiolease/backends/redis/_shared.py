"""What the Redlock backend (:mod:`aiolease.backends.redlock`) shares with the Redis
backend: the one interface between the two packages.

Redlock runs the same kind of lease on each of its instances, so it uses the Redis
backend's key layout, the Lua functions that read a lease, the scripts' millisecond
arguments, the holder decoding of READ replies, the error mapping, the pub/sub
subscriptions, and redis-py's transport for their connections; nothing else of this
package, and nothing of :class:`~aiolease.backends.redis.RedisBackend`.
"""

from ._clients import where
from ._errors import mapped_error
from ._keys import DEFAULT_PREFIX, Keys, check_prefix
from ._pubsub import Subscriptions
from ._replies import holder_from
from ._scripts import FOREIGN, LEASE_FUNCTIONS, READ_BODY, Script, evaluate, ms
from ._transport import RedisPyTransport
from ._url import query_pairs

__all__ = [
    "DEFAULT_PREFIX",
    "FOREIGN",
    "LEASE_FUNCTIONS",
    "READ_BODY",
    "Keys",
    "RedisPyTransport",
    "Script",
    "Subscriptions",
    "check_prefix",
    "evaluate",
    "holder_from",
    "mapped_error",
    "ms",
    "query_pairs",
    "where",
]
