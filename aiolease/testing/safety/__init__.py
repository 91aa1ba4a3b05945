"""The safety harness: several OS processes contend for one name under faults.

It is the proof of aiolease's central promise: *the old holder stops before anyone
else can start; tokens fence whatever slips through*. Each worker process runs
``async with AsyncLock(...)`` in a loop; each body records its interval on
``time.monotonic()`` (one clock for every process of a Linux host) and writes to a
fenced resource with its token. The controller injects faults on a schedule
(``SIGSTOP`` of the holder, ``SIGKILL`` of the holder, a blackholed network, a
server restart, an etcd leader kill), then checks the records: no two bodies
overlap unless a pause explains it (a killed holder's last body counts as running
until the kill), no stale write is ever accepted, tokens increase in body order,
and every lost lease ended its body with :class:`~aiolease.LeaseLostError`::

    python -m aiolease.testing.safety --url sqlite:////tmp/s.db --fault none --fault sigstop
    # safety sqlite  none     runs=1 acquisitions=8 losses=0 faults=0 overlaps=0 ...
    # safety sqlite  sigstop  runs=1 acquisitions=7 losses=2 faults=2 overlaps=0
    #                         paused_overlaps=2 stale_accepted=0 stale_rejected=2 ...

    report = await run_safety("memory://", fault=Fault.BLACKHOLE, duration=5, ttl=0.5)
    assert report.ok, report.line()

Two forms check semaphores and read-write locks (``limit=N`` / ``--limit N``:
never more than ``N`` bodies at once outside a pause; ``rw=True`` / ``--rw``: a
writer never together with anyone), see :mod:`._check` and :mod:`._fence` for what
the fence means there.

``memory://`` is hosted for the run in a server process
(:mod:`aiolease.testing.remote`); with ``blackhole`` each worker reaches it
through its own :class:`~aiolease.testing.proxy.FaultProxy`. A fault that means
nothing for a backend (``blackhole`` on SQLite, ``server-restart`` where tokens
do not survive a restart) is reported as ``n/a``, never silently passed.

Modules: :mod:`._run` (the controller), :mod:`._worker` (one contender),
:mod:`._fence` (the fenced resource), :mod:`._check` (the checker),
:mod:`._faults` (faults and server control), :mod:`._report` (the summary).
"""

from ._check import Findings as Findings
from ._check import check as check
from ._cli import main as main
from ._faults import CommandServerControl as CommandServerControl
from ._faults import Fault as Fault
from ._faults import FaultEvent as FaultEvent
from ._faults import ServerControl as ServerControl
from ._fence import Fence as Fence
from ._records import Accepted as Accepted
from ._records import Hold as Hold
from ._records import Pause as Pause
from ._records import Records as Records
from ._records import Write as Write
from ._records import read_records as read_records
from ._report import SafetyReport as SafetyReport
from ._report import assert_safe as assert_safe
from ._run import run_safety as run_safety

__all__ = [
    "Accepted",
    "CommandServerControl",
    "Fault",
    "FaultEvent",
    "Fence",
    "Findings",
    "Hold",
    "Pause",
    "Records",
    "SafetyReport",
    "ServerControl",
    "Write",
    "assert_safe",
    "check",
    "main",
    "read_records",
    "run_safety",
]
