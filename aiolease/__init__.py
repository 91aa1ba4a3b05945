"""aiolease: distributed locks, leases and leader election for asyncio and trio."""

from ._elector import Elector as Elector
from ._elector import ElectorStatistics as ElectorStatistics
from ._elector import LeaderInfo as LeaderInfo
from ._events import Events as Events
from ._events import Observer as Observer
from ._events import subscribe_all as subscribe_all
from ._exceptions import AioleaseError as AioleaseError
from ._exceptions import BackendError as BackendError
from ._exceptions import BackendNotFound as BackendNotFound
from ._exceptions import BackendTimeout as BackendTimeout
from ._exceptions import BackendUnavailable as BackendUnavailable
from ._exceptions import ForeignDataError as ForeignDataError
from ._exceptions import InvalidArgument as InvalidArgument
from ._exceptions import LeaseError as LeaseError
from ._exceptions import LeaseExpiredError as LeaseExpiredError
from ._exceptions import LeaseHeldError as LeaseHeldError
from ._exceptions import LeaseLostError as LeaseLostError
from ._exceptions import LimitMismatchError as LimitMismatchError
from ._exceptions import LossReason as LossReason
from ._exceptions import NotOwnerError as NotOwnerError
from ._exceptions import ReentrantAcquireError as ReentrantAcquireError
from ._exceptions import UnsupportedCapability as UnsupportedCapability
from ._lease import Lease as Lease
from ._lease import Timing as Timing
from ._lock import AsyncLock as AsyncLock
from ._lock import LockStatistics as LockStatistics
from ._registry import open_backend as open_backend
from ._schedule import run_at_most_once as run_at_most_once
from ._schedule import run_every as run_every
from ._semaphore import AsyncReadWriteLock as AsyncReadWriteLock
from ._semaphore import AsyncSemaphore as AsyncSemaphore
from ._semaphore import ReadWriteLockStatistics as ReadWriteLockStatistics
from ._semaphore import ReadWriteMode as ReadWriteMode
from ._semaphore import SemaphoreStatistics as SemaphoreStatistics
from .abc import Backend as Backend
from .abc import Capability as Capability
from .abc import HolderInfo as HolderInfo

__version__ = "0.1.0.dev0"

__all__ = [
    "AioleaseError",
    "AsyncLock",
    "AsyncReadWriteLock",
    "AsyncSemaphore",
    "Backend",
    "BackendError",
    "BackendNotFound",
    "BackendTimeout",
    "BackendUnavailable",
    "Capability",
    "Elector",
    "ElectorStatistics",
    "Events",
    "ForeignDataError",
    "HolderInfo",
    "InvalidArgument",
    "Lease",
    "LeaseError",
    "LeaseExpiredError",
    "LeaseHeldError",
    "LeaseLostError",
    "LeaderInfo",
    "LimitMismatchError",
    "LockStatistics",
    "LossReason",
    "NotOwnerError",
    "Observer",
    "ReadWriteLockStatistics",
    "ReadWriteMode",
    "ReentrantAcquireError",
    "SemaphoreStatistics",
    "Timing",
    "UnsupportedCapability",
    "open_backend",
    "subscribe_all",
    "run_at_most_once",
    "run_every",
]
