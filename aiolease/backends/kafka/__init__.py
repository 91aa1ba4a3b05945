"""The Kafka backend: leader election through consumer-group membership. Election-only.

URLs::

    kafka://[user:password@]host[:port][,host[:port]...][?option=value&...]

Options, in the query or as keyword arguments: ``group_prefix`` and ``topic_prefix``
(default ``aiolease.``), ``session_timeout`` (seconds; default: the ttl of the first
campaign for a name), ``heartbeat_interval`` (default a tenth of the session
timeout), ``timeout`` (seconds per request, default 5), ``replication_factor`` (of
the topics created, default 1), and the security settings passed to aiokafka as they
are (``security_protocol``, ``sasl_mechanism``, ``ssl_context``; a user and password
in the URL are the SASL PLAIN login). An ``aiokafka.AIOKafkaClient`` the application
already has is used as it is, and never closed by the backend; each group membership
has a connection of its own, made with that client's settings (all of them but
``request_timeout_ms``: the backend bounds its requests itself, with ``timeout``)::

    backend = KafkaBackend(client, group_prefix="myapp.")

How it works (``docs/internals/kafka.md`` has the whole argument):

* **One consumer group per name** (``<group_prefix><name>``) over a one-partition
  topic (``<topic_prefix><name>``, created if missing). Each backend object is at most
  one member of a name's group, shared by the candidates it serves. The member that
  the assignment gives partition 0 leads; the assignor (:mod:`._group`) carries each
  member's identity and metadata in the group protocol's user data, so that every
  member knows who leads.
* **Token**: ``max(committed offset of partition 0, the highest token any member
  has seen) + 1``, decided by the assignor, then committed by the new leader with its
  generation (a stale generation is refused by the broker) before its term starts.
  The committed offset is the durable epoch: tokens survive a broker restart if the
  broker keeps its committed offsets (Kafka's ``__consumer_offsets``), and otherwise
  as long as one member that saw the last token stays alive.
* **Loss**: the term's local deadline is the send time of the last heartbeat the
  coordinator answered, plus the session timeout, minus the core's margin. A
  rebalance ends the term before the member rejoins (Kafka's eager protocol).
* **Resign** leaves the group at once.
* **Election only**: :class:`~aiolease.AsyncLock` refuses this backend
  (:class:`~aiolease.UnsupportedCapability`), since every acquire and release would
  be a rebalance of the group.
"""

from ._backend import KafkaBackend, KafkaStatistics

__all__ = ["KafkaBackend", "KafkaStatistics"]
