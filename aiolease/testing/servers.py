"""Where the real servers of the test suite are, and what to do when one is missing.

``scripts/services.sh start`` starts every server below on these default
addresses; an env var moves a server elsewhere::

    AIOLEASE_REDIS_URL=redis://10.0.0.5:6379/0 pytest

A test asks for a server with the ``aiolease_server`` fixture (see
:mod:`aiolease.testing.pytest_plugin`), which checks that every address in the
URL accepts connections. When one does not, the test **fails**, always in CI
(``CI=true``). Only a developer who opts out locally (``AIOLEASE_ALLOW_SKIP=1``,
and not in CI) gets a skip, with the reason.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

__all__ = [
    "ALLOW_SKIP_ENV",
    "SERVICES_DIR_ENV",
    "SERVERS",
    "Server",
    "ServerUnreachable",
    "allow_skip",
    "server",
    "services_dir",
]

#: Set to ``1`` to skip, not fail, tests whose server cannot be reached (never in CI).
ALLOW_SKIP_ENV = "AIOLEASE_ALLOW_SKIP"
#: Where ``scripts/services.sh`` keeps each server's data, logs and pidfiles.
SERVICES_DIR_ENV = "AIOLEASE_SERVICES_DIR"


def services_dir() -> Path:
    """``$AIOLEASE_SERVICES_DIR``, else ``$XDG_STATE_HOME/aiolease/services``
    (``~/.local/state/aiolease/services``): one per machine, as ``scripts/services.sh``
    has it, because the servers hold the machine's ports."""
    configured = os.environ.get(SERVICES_DIR_ENV)
    if configured:
        return Path(configured).resolve()
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return (Path(state) / "aiolease" / "services").resolve()


class ServerUnreachable(Exception):
    """A server the tests need does not accept connections."""


@dataclass(frozen=True)
class Server:
    """One real server of the test suite.

    :param name: the service name in ``scripts/services.sh``
    :param env: the env var that overrides :attr:`default`
    :param default: the URL that ``scripts/services.sh`` serves
    """

    name: str
    env: str
    default: str

    @property
    def url(self) -> str:
        """``$env`` if set and not empty, else the default."""
        return os.environ.get(self.env) or self.default

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Every ``(host, port)`` in :attr:`url` (``host:port,host:port`` is allowed).

        A host without a port gets the default URL's first port.
        """
        default_port = _netloc_addresses(self.default)[0][1] or 0
        return [(host, port or default_port) for host, port in _netloc_addresses(self.url)]

    def check(self, timeout: float = 2.0) -> None:
        """Connect to every address once.

        :raises ServerUnreachable: naming the address, the env var and how to start it
        """
        for host, port in self.addresses:
            try:
                socket.create_connection((host, port), timeout=timeout).close()
            except OSError as exc:
                raise ServerUnreachable(
                    f"{self.name} server at {host}:{port} is unreachable ({exc}); "
                    f"start it with `bash scripts/services.sh start {self.name}` "
                    f"or point ${self.env} at one"
                ) from exc


def _netloc_addresses(url: str) -> list[tuple[str, int | None]]:
    netloc = urlsplit(url).netloc.rpartition("@")[2]
    found: list[tuple[str, int | None]] = []
    for part in netloc.split(","):
        host, _, port = part.rpartition(":")
        if not port.isdigit() or (":" in host and not host.endswith("]")):
            host, port = part, ""  # no port, or a bare IPv6 address
        found.append((host.strip("[]") or "127.0.0.1", int(port) if port else None))
    return found


#: The servers that ``scripts/services.sh`` provides, by service name.
SERVERS: dict[str, Server] = {
    s.name: s
    for s in [
        Server("redis", "AIOLEASE_REDIS_URL", "redis://127.0.0.1:6379/0"),
        Server("redis-aof", "AIOLEASE_REDIS_AOF_URL", "redis://127.0.0.1:6380/0"),
        Server(
            "redis-cluster",
            "AIOLEASE_REDIS_CLUSTER_URL",
            "redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002",
        ),
        Server(
            "redis-sentinel",
            "AIOLEASE_REDIS_SENTINEL_URL",
            "redis+sentinel://127.0.0.1:26379/aiolease",
        ),
        Server(
            "redis-redlock",
            "AIOLEASE_REDLOCK_URL",
            "redis+redlock://127.0.0.1:6381,127.0.0.1:6382,127.0.0.1:6383",
        ),
        Server("postgres", "AIOLEASE_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"),
        Server("pgbouncer", "AIOLEASE_PGBOUNCER_URL", "postgresql://postgres@127.0.0.1:6432/test"),
        Server(
            "postgres-restart",
            "AIOLEASE_POSTGRES_RESTART_URL",
            "postgresql://postgres@127.0.0.1:5433/test",
        ),
        Server("mariadb", "AIOLEASE_MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
        Server(
            "mariadb-restart", "AIOLEASE_MARIADB_RESTART_URL", "mysql://root@127.0.0.1:3307/test"
        ),
        Server("etcd", "AIOLEASE_ETCD_URL", "etcd://127.0.0.1:2379"),
        Server(
            "etcd-cluster",
            "AIOLEASE_ETCD_CLUSTER_URL",
            "etcd://127.0.0.1:23790,127.0.0.1:23791,127.0.0.1:23792",
        ),
        Server("mongo", "AIOLEASE_MONGO_URL", "mongodb://127.0.0.1:27017/aiolease?replicaSet=rs0"),
        Server(
            "mongo-standalone",
            "AIOLEASE_MONGO_STANDALONE_URL",
            "mongodb://127.0.0.1:27018/aiolease?directConnection=true",
        ),
        Server("kafka", "AIOLEASE_KAFKA_URL", "kafka://127.0.0.1:9092"),
        Server("kafka-restart", "AIOLEASE_KAFKA_RESTART_URL", "kafka://127.0.0.1:19092"),
        Server("zookeeper", "AIOLEASE_ZOOKEEPER_URL", "zookeeper://127.0.0.1:2181"),
        Server(
            "zookeeper-ensemble",
            "AIOLEASE_ZOOKEEPER_ENSEMBLE_URL",
            "zookeeper://127.0.0.1:21811,127.0.0.1:21812,127.0.0.1:21813",
        ),
    ]
}


def server(name: str) -> Server:
    """The server called ``name``.

    :raises KeyError: naming the known servers
    """
    try:
        return SERVERS[name]
    except KeyError:
        raise KeyError(f"no test server {name!r}; known: {', '.join(SERVERS)}") from None


def allow_skip() -> bool:
    """True when a missing server may skip a test: opted out, and not in CI."""
    in_ci = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
    return not in_ci and os.environ.get(ALLOW_SKIP_ENV) == "1"
