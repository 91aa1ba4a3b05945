from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

pytest_plugins = ["pytester"]


#: Keeps pytest-asyncio (in the test extra, for tests/testing/test_pytest_asyncio.py)
#: out of a pytest, as pyproject.toml's addopts keep it out of this one.
NO_PYTEST_ASYNCIO = "-p no:asyncio"


#: Tests that kill a server, or lean on one that another test kills, by the server.
#: ``scripts/test.sh`` runs the suite on two pytest-xdist workers; each group below is
#: one unit of work, run on one worker, one test at a time, so that no test meets a
#: server that a test on the other worker has killed. Each entry is the start of the
#: node ids it takes (a directory, a module, a test function), with at most one ``*``
#: between that start and their end. Every other test is a unit of its own, as in
#: ``--dist load``.
SERVER_GROUPS: dict[str, tuple[str, ...]] = {
    # Its leader member killed by test_etcd_faults.py, test_etcd_safety.py and
    # test_etcd_cluster.py; the cluster serves every etcd test (etcd_url's params).
    "etcd-cluster": (
        "tests/backends/etcd/",
        "tests/testing/test_etcd_cluster.py::",
        "tests/testing/test_servers.py::test_etcd_cluster_every_member",
    ),
    "zookeeper-ensemble": (
        "tests/backends/zookeeper/test_zookeeper_safety.py::",
        "tests/testing/test_servers.py::test_zookeeper_ensemble_every_member",
    ),
    # The master killed (a failover), the replica awaited.
    "redis-sentinel": (
        "tests/backends/redis/test_redis_sentinel.py::",
        "tests/backends/test_bad_input.py::test_bad_calls_raise_and_leave_a_held_lease_alone[*-redis-sentinel]",
        "tests/backends/test_urls.py::test_the_repr_of_a_backend_opened_with_a_password_hides_it[*-redis-sentinel]",
    ),
    "redis-aof": ("tests/backends/redis/test_redis_safety.py::",),
    "sql-restart": ("tests/backends/sql/test_sql_safety.py::",),
    # The standalone server killed, and the replica set's primary stepped down, by
    # test_mongo_safety.py (and test_mongo_standalone.py): the replica set serves every
    # MongoDB test, and one that ran beside the step-down saw "not primary" errors and
    # waits past its permits' ttl (seen once a new module's tests moved the others).
    "mongo": ("tests/backends/mongo/",),
    # Restarted by test_kafka_safety.py; and every Kafka test on one worker: elections
    # on one broker wait on its group rebalances, which two workers' tests slow past
    # the elector-term checks' 30 s guard.
    "kafka": ("tests/backends/kafka/",),
    # Not killed but filled: test_many_concurrent_statements_through_the_pooler runs
    # more clients than the pooler has server connections (10) for several seconds, and
    # a conformance check through the pooler on the other worker waited past its bound
    # (a semaphore check's 4 s, on a slow machine).
    "pgbouncer": ("tests/backends/postgres/test_pgbouncer.py::",),
}


def server_group(nodeid: str) -> str | None:
    """The :data:`SERVER_GROUPS` group of the test ``nodeid``, if any."""
    for group, entries in SERVER_GROUPS.items():
        for entry in entries:
            start, star, end = entry.partition("*")
            if nodeid.startswith(start) and (not star or nodeid.endswith(end)):
                return group
    return None


try:
    # pytest-xdist ships no type information.
    from xdist.scheduler import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
        LoadScopeScheduling,
    )
except ImportError:  # pragma: no cover - pytest-xdist is in the test extra
    pass
else:

    class ServerGroupScheduling(LoadScopeScheduling):  # type: ignore[misc,unused-ignore]
        """``--dist load``, but each :data:`SERVER_GROUPS` group is one unit of work.

        (pytest-xdist's own ``--dist loadgroup`` renames node ids, which pytest 9 no
        longer lets a plugin do: its groups are silently ignored.)
        """

        def _split_scope(self, nodeid: str) -> str:
            group = server_group(nodeid)
            return nodeid if group is None else f"group:{group}"

        def remove_node(self, node: Any) -> str | None:
            """A worker ended: put back in the queue only the tests it had not run, not
            the one it crashed in (as ``--dist load`` does: its crash is its report).

            pytest-xdist's own puts back every unit the worker had been given, finished
            ones too; the worker that replaces a crashed one could be handed a finished
            unit, get no test to run, never report one, and so never be given the rest:
            the run waited forever (a test killed by pytest-timeout did that)."""
            workload: dict[str, dict[str, bool]] = self.assigned_work.pop(node)
            left = [n for unit in workload.values() for n, done in unit.items() if not done]
            if not left:
                return None
            crashed = left[0]  # the worker runs its tests in the order they were given
            for scope, unit in workload.items():
                rest = {n: False for n, done in unit.items() if not done and n != crashed}
                if rest:
                    self.workqueue[scope] = rest
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

    @pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown under -p no:xdist
    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        """With ``-n`` (``--dist load``): :class:`ServerGroupScheduling`."""
        if config.getvalue("dist") != "load":
            return None
        return ServerGroupScheduling(config, log)


@pytest.fixture
def pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """pytester, whose pytests (in process or not) run without pytest-asyncio, as this
    suite does (tests/testing/test_pytest_asyncio.py lets it in)."""
    given = os.environ.get("PYTEST_ADDOPTS", "")
    monkeypatch.setenv("PYTEST_ADDOPTS", f"{given} {NO_PYTEST_ASYNCIO}".strip())
    return pytester


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs under asyncio and under trio."""
    return str(request.param)


@pytest.fixture
def redis_url(aiolease_server: Callable[[str], str]) -> str:
    """The URL of the ``redis`` server (tests/backends/redis/)."""
    return aiolease_server("redis")
