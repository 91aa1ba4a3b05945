"""PostgreSQL and MariaDB under the safety harness, and server restarts mid-hold.

OS processes contend for one lease while holders are paused (``SIGSTOP``) or cut off
(a blackholing proxy), on the shared servers (``postgres`` :5432, ``mariadb`` :3306).
Server restarts never touch those: they SIGKILL the dedicated servers
``postgres-restart`` (:5433) and ``mariadb-restart`` (:3307), which commit to disk
before they answer, and start them again with ``scripts/services.sh``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from aiolease import (
    AsyncLock,
    BackendError,
    BackendUnavailable,
    Elector,
    Lease,
    LeaseLostError,
    LossReason,
    open_backend,
)
from aiolease.abc import Backend, HolderInfo
from aiolease.testing.faults import FaultyBackend
from aiolease.testing.safety import Fault, assert_safe
from tests.backends.safety import (
    CUT_OFF_FRESH,
    ServiceRestart,
    alternating_loops,
    assert_fault_took_effect,
    assert_pause_took_effect,
    pause_took_effect,
    short_run,
)
from tests.backends.safety import restartable as restart_control
from tests.backends.sql.support import DATABASES, Database
from tests.support import refused, unique

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

DURATION = {
    Fault.SIGSTOP: 2.5,
    Fault.BLACKHOLE: 2.0,
    # A restarted database (crash recovery, then the services.sh checks) is back after
    # 0.5-2 s here, depending on load: the workers must get to contend again after it.
    Fault.SERVER_RESTART: 5.0,
}


def restartable(database: Database, aiolease_server: Callable[[str], str]) -> ServiceRestart:
    """The control of ``database``'s dedicated server, which services.sh must have started."""
    aiolease_server(database.restartable)  # reachable, or a failure (a skip if opted out)
    return restart_control(database.restartable, database.pidfile)


# -- the safety harness ---------------------------------------------------------------------


def _cases() -> list[Any]:
    """Each fault once per database, the workers' loop alternating between faults and
    databases (so each database meets both loops) to keep the runs few. (No ``none``
    run: every run checks that no bodies overlap outside a pause.)"""
    faults = [Fault.SIGSTOP, Fault.BLACKHOLE, Fault.SERVER_RESTART]
    return [
        case
        for offset, database in enumerate(DATABASES)
        for case in alternating_loops([(database, fault) for fault in faults], offset)
    ]


@pytest.mark.parametrize(("database_name", "fault", "anyio_backend"), _cases())
async def test_sql_is_safe(
    database_name: str,
    aiolease_server: Callable[[str], str],
    tmp_path: Path,
    anyio_backend: str,
    fault: Fault,
) -> None:
    database = DATABASES[database_name]
    options: dict[str, Any] = {}
    service = database.shared
    control = None
    if fault is Fault.SERVER_RESTART:
        service = database.restartable
        control = options["server_control"] = restartable(database, aiolease_server)
        options["fault_every"] = 1.5  # contention between restarts
    aiolease_server(service)
    if fault is Fault.BLACKHOLE:
        options = dict(CUT_OFF_FRESH)
    report = await short_run(
        database.url(service), fault, anyio_backend, tmp_path, DURATION, **options
    )
    print(report.line())
    assert report.applicable, report.reason
    assert_fault_took_effect(report, fault)
    if control is not None:
        assert control.kills >= 1, report.line()


#: The semaphore and read-write forms: each form meets both databases, both faults and
#: both loops once (four runs in all).
_PERMIT_CASES = alternating_loops(
    [
        ("postgres", Fault.SIGSTOP, "semaphore"),
        ("mariadb", Fault.SERVER_RESTART, "semaphore"),
        ("postgres", Fault.SERVER_RESTART, "rw"),
        ("mariadb", Fault.SIGSTOP, "rw"),
    ]
)


@pytest.mark.parametrize(("database_name", "fault", "form", "anyio_backend"), _PERMIT_CASES)
async def test_sql_permits_are_safe(
    database_name: str,
    aiolease_server: Callable[[str], str],
    tmp_path: Path,
    anyio_backend: str,
    fault: Fault,
    form: str,
) -> None:
    """Semaphore (limit 2 of 4 workers): never more than two bodies at once outside a
    pause. Read-write: a writer never with anyone outside a pause, a stale writer
    refused by the fence. Under SIGSTOP of a holder, or a kill of the server."""
    database = DATABASES[database_name]
    options: dict[str, Any] = {"limit": 2} if form == "semaphore" else {"rw": True}
    service = database.shared
    control = None
    if fault is Fault.SERVER_RESTART:
        service = database.restartable
        control = options["server_control"] = restartable(database, aiolease_server)
        options["fault_every"] = 1.5  # contention between restarts
    aiolease_server(service)
    report = await short_run(
        database.url(service), fault, anyio_backend, tmp_path, DURATION, **options
    )
    print(report.line())
    assert report.applicable, report.reason
    assert_safe(report)
    if fault is Fault.SIGSTOP and not pause_took_effect(report):
        # Safe, but no body ran while a holder was frozen: on a loaded machine a run of
        # 2.5 s may see too few acquisitions (a trio worker starts late). One more run,
        # checked for safety too, must show the pause taking effect.
        report = await short_run(
            database.url(service), fault, anyio_backend, tmp_path / "again", DURATION, **options
        )
        print(report.line())
        assert_safe(report)
    if fault is Fault.SIGSTOP:
        assert_pause_took_effect(report)
    if control is not None:
        assert control.kills >= 1, report.line()


# -- a restart while a lease is held ---------------------------------------------------------------


async def raise_token(backend: Backend, name: str, grants: int) -> int:
    """Grant and release ``name`` ``grants`` times; the last token."""
    token = 0
    for _ in range(grants):
        async with AsyncLock(backend, name, ttl=30) as lease:
            token = lease.token
    return token


async def restart(control: ServiceRestart) -> None:
    """Kill the server and start it again, even if the caller is cancelled meanwhile
    (a start cut short could leave the server down for the tests that follow)."""
    with anyio.CancelScope(shield=True):
        await control.kill()
        await control.start()


async def refused_again(backend: Backend, name: str) -> HolderInfo:
    """``try_acquire`` by an intruder, which must be refused, once the backend's pooled
    connections have noticed a restart (a dead one fails one call, as a retry would)."""
    for _ in range(10):
        try:
            return await refused(backend, name, "intruder")
        except BackendUnavailable:
            pass
    return await refused(backend, name, "intruder")


@dataclass
class Contender:
    """Waits for a lease through its own backend object, across server failures."""

    backend: Backend
    name: str
    lease: Lease | None = None
    granted_at: float | None = None

    def __post_init__(self) -> None:
        self.granted = anyio.Event()

    async def run(self) -> None:
        lock = AsyncLock(self.backend, self.name, ttl=5.0)
        while True:
            try:
                self.lease = await lock.acquire()
            except BackendError:  # the server is down: try again
                await anyio.sleep(0.1)
                continue
            self.granted_at = anyio.current_time()
            self.granted.set()
            return


async def test_a_restart_mid_hold_keeps_the_lease_or_ends_it_loudly(
    database: Database, aiolease_server: Callable[[str], str], anyio_backend: str
) -> None:
    """The server is killed and started again while an AsyncLock holds (ttl 4 s), and a
    contender waits for the name through a backend object of its own.

    Either the holder's renewals reach the restarted server before its local deadline
    and it still holds (the contender has nothing; the server shows the holder with its
    token), or the body ends with LeaseLostError before the contender gets the name.
    Never a silent double holder; the token column survives the restart, so the
    contender's grant has a higher token.
    """
    control = restartable(database, aiolease_server)
    url = database.url(database.restartable)
    name = unique("restart_hold")
    async with open_backend(url) as b, open_backend(url) as other:
        before = await raise_token(b, name, 2)
        spy = FaultyBackend(b)
        lock = AsyncLock(spy, name, ttl=4.0)
        contender = Contender(other, name)
        lease: Lease | None = None
        stopped_at = outcome = None
        async with anyio.create_task_group() as tg:
            try:
                with anyio.fail_after(60):
                    async with lock as lease:
                        assert lease.token == before + 1
                        tg.start_soon(contender.run)
                        try:
                            await restart(control)
                            # A renewal confirmed after this is the restarted server's.
                            renewals = lock.statistics().renewals
                            while lock.statistics().renewals < renewals + 1:
                                await spy.wait_called("renew")
                            holder = await refused_again(other, name)
                            assert (holder.owner, holder.token) == (lease.owner, lease.token)
                            assert contender.lease is None
                            outcome = "kept"
                        finally:
                            stopped_at = anyio.current_time()
            except LeaseLostError as exc:
                assert exc.reason in (LossReason.UNREACHABLE, LossReason.EXPIRED), exc
                outcome = f"lost ({exc.reason.value})"
            with anyio.fail_after(60):
                await contender.granted.wait()
        print(f"{database.restartable}: the lease was {outcome} across the restart")
        assert lease is not None and contender.lease is not None
        assert stopped_at is not None and contender.granted_at is not None
        assert stopped_at <= contender.granted_at
        assert contender.lease.token > lease.token
        await contender.lease.release()
    assert control.kills == 1


async def test_a_server_down_past_the_ttl_ends_the_term_and_fences_the_next(
    database: Database, aiolease_server: Callable[[str], str], anyio_backend: str
) -> None:
    """An Elector leads (ttl 1 s) when its server is killed, and the server stays down
    until the term has ended: the work is cancelled (the leader cannot renew, so it
    must stop). Once the server is back, the elector wins a new term, whose token is
    higher than the old one: the token column survived the crash."""
    control = restartable(database, aiolease_server)
    url = database.url(database.restartable)
    name = unique("restart_term")
    async with open_backend(url) as b:
        before = await raise_token(b, name, 2)
        terms: list[Lease] = []
        elected = [anyio.Event(), anyio.Event()]
        first_ended = anyio.Event()
        reasons: list[LossReason] = []

        async def work(lease: Lease) -> None:
            terms.append(lease)
            elected[min(len(terms), 2) - 1].set()
            try:
                await anyio.sleep_forever()
            finally:
                if len(terms) == 1:
                    first_ended.set()

        elector = Elector(b, name, ttl=1.0, on_defeated=reasons.append)
        async with anyio.create_task_group() as tg:
            tg.start_soon(elector.run, work)
            with anyio.fail_after(30):
                await elected[0].wait()
            with anyio.CancelScope(shield=True):
                await control.kill()
                try:
                    with anyio.fail_after(30):
                        await first_ended.wait()  # while the server is down
                    assert not elector.is_leader
                finally:
                    await control.start()
            with anyio.fail_after(60):
                await elected[1].wait()
            tg.cancel_scope.cancel()
    assert reasons[0] in (LossReason.UNREACHABLE, LossReason.EXPIRED), reasons
    assert terms[0].token == before + 1
    assert terms[1].token > terms[0].token
