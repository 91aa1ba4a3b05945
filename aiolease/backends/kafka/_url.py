"""``kafka://`` URLs and connection options.

::

    kafka://[user:password@]host[:port][,host[:port]...][?option=value&...]

A host without a port gets 9092. Options (in the query, or as keyword arguments to
``from_url``, not both): ``group_prefix`` and ``topic_prefix`` (default
``aiolease.``), ``session_timeout`` and ``heartbeat_interval`` (seconds; by default
the lease's ttl and a tenth of the session timeout), ``timeout`` (seconds per
request, default 5), ``replication_factor`` (of the topics created, default 1), and
the security settings handed to aiokafka as they are: ``security_protocol``,
``sasl_mechanism`` (the user and password come from the URL), ``ssl_context`` (a
keyword argument only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..._exceptions import InvalidArgument
from ..._urls import EndpointsUrl, parse_endpoints_url

__all__ = ["DEFAULT_PORT", "HEARTBEAT_SHARE", "KafkaUrl", "Settings", "parse_url", "settings_of"]

#: Kafka's client port.
DEFAULT_PORT = 9092
#: The default heartbeat interval, as a share of the session timeout. A member learns
#: of a rebalance (a resign, a dead leader dropped) only at its next heartbeat, so the
#: interval adds to every hand-off; a tenth keeps that small for about one cheap
#: request per member every tenth of a session (Kafka's consumer default is 3 s for
#: a 45 s session, a fifteenth; its guidance is at most a third).
HEARTBEAT_SHARE = 0.1
#: Options taken by :meth:`KafkaBackend.from_url <aiolease.backends.kafka.KafkaBackend.from_url>`.
OPTIONS = frozenset(
    {
        "group_prefix",
        "topic_prefix",
        "session_timeout",
        "heartbeat_interval",
        "timeout",
        "replication_factor",
        "security_protocol",
        "sasl_mechanism",
        "ssl_context",
    }
)
#: The options handed to aiokafka's client unchanged.
PASSED_THROUGH = frozenset({"security_protocol", "sasl_mechanism", "ssl_context"})


@dataclass(frozen=True)
class Settings:
    """What the backend needs from its options (the client's own are apart).

    :param group_prefix: put before a lease name to make its consumer group id
    :param topic_prefix: put before a lease name to make its topic name
    :param session_timeout: seconds, or ``None``: the ttl of the first acquire
    :param heartbeat_interval: seconds, or ``None``: :data:`HEARTBEAT_SHARE` of the
        session timeout
    :param timeout: seconds one request may take
    :param replication_factor: of the topics the backend creates
    """

    group_prefix: str = "aiolease."
    topic_prefix: str = "aiolease."
    session_timeout: float | None = None
    heartbeat_interval: float | None = None
    timeout: float = 5.0
    replication_factor: int = 1

    def heartbeat_for(self, session: float) -> float:
        """Seconds between two heartbeats of a member whose session is ``session``."""
        return self.heartbeat_interval or HEARTBEAT_SHARE * session


class KafkaUrl(EndpointsUrl):
    """A parsed ``kafka://`` URL: its bootstrap brokers, user and options."""

    def client_options(self) -> dict[str, Any]:
        """What goes to ``aiokafka.AIOKafkaClient`` besides the servers."""
        passed = {key: value for key, value in self.options.items() if key in PASSED_THROUGH}
        if self.user is not None:
            passed["sasl_plain_username"], passed["sasl_plain_password"] = self.user
            passed.setdefault("sasl_mechanism", "PLAIN")
            passed.setdefault("security_protocol", "SASL_PLAINTEXT")
        return passed


def parse_url(url: str, options: Mapping[str, Any]) -> KafkaUrl:
    """Split ``url`` and merge the keyword ``options`` in.

    :raises InvalidArgument: a malformed URL, an unknown option, or one given twice
    """
    parsed = parse_endpoints_url(
        url,
        options,
        scheme="kafka",
        what="a Kafka",
        server="kafka broker",
        known=OPTIONS,
        default_port=DEFAULT_PORT,
        path_hint="give prefixes as ?group_prefix=...",
    )
    if "ssl_context" in parsed.options and "ssl_context" not in options:
        raise InvalidArgument("the Kafka option ssl_context is given as a keyword argument")
    return KafkaUrl(parsed.endpoints, parsed.user, parsed.options)


def _seconds(what: str, value: object) -> float:
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidArgument(f"Kafka option {what}={value!r} is not a number") from None
    if not 0 < seconds <= 3600 or isinstance(value, bool):
        raise InvalidArgument(f"Kafka option {what}={value!r} is not in (0, 3600] seconds")
    return seconds


def _prefix(what: str, value: object) -> str:
    from ._names import check_prefix

    if not isinstance(value, str):
        raise InvalidArgument(f"Kafka option {what} must be a str, not {type(value).__name__}")
    return check_prefix(what, value)


def settings_of(options: Mapping[str, Any]) -> Settings:
    """The backend's own settings from the merged options.

    :raises InvalidArgument: a value is malformed or out of range
    """
    defaults = Settings()
    session = options.get("session_timeout")
    heartbeat = options.get("heartbeat_interval")
    replication = options.get("replication_factor", defaults.replication_factor)
    if isinstance(replication, bool) or not str(replication).strip().lstrip("-").isdigit():
        raise InvalidArgument(f"Kafka option replication_factor={replication!r} is not an integer")
    if not 1 <= int(replication) <= 32767:
        raise InvalidArgument(f"Kafka option replication_factor={replication!r} is out of range")
    settings = Settings(
        group_prefix=_prefix("group_prefix", options.get("group_prefix", defaults.group_prefix)),
        topic_prefix=_prefix("topic_prefix", options.get("topic_prefix", defaults.topic_prefix)),
        session_timeout=None if session is None else _seconds("session_timeout", session),
        heartbeat_interval=None if heartbeat is None else _seconds("heartbeat_interval", heartbeat),
        timeout=_seconds("timeout", options.get("timeout", defaults.timeout)),
        replication_factor=int(replication),
    )
    if (
        settings.session_timeout is not None
        and settings.heartbeat_interval is not None
        and settings.heartbeat_interval >= settings.session_timeout / 2
    ):
        raise InvalidArgument("Kafka option heartbeat_interval must be under half session_timeout")
    return settings
