"""What the SQL backends share: identifiers, URL options, rows, wake-ups, batched renewals.

Nothing here imports a driver. :mod:`aiolease.backends.postgres` and
:mod:`aiolease.backends.mysql` keep one row per lease name::

    name | token | owner | identity | metadata | ttl | acquired_at | expires_at

A released row stays, with its owner cleared, so the token column only grows.

Like the drivers, this runs on asyncio only (under trio the core bridges it through
trio-asyncio), so it uses :mod:`asyncio` primitives, never anyio's: anyio binds
``asyncio.get_running_loop`` when it is imported, which may be before trio-asyncio
patches it.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from .._exceptions import BackendError, InvalidArgument, LossReason
from .._validate import check_count, check_seconds
from ._asyncio import now, run_to_end, timeout_after

T = TypeVar("T")

__all__ = [
    "IDENTIFIER_RE",
    "Key",
    "RenewBatcher",
    "SWEEP_AFTER",
    "SWEEP_LIMIT",
    "Sweeps",
    "Takers",
    "Wakeups",
    "check_identifier",
    "check_owner",
    "encode_metadata",
    "finished",
    "parse_bool",
    "parse_count",
    "parse_query",
    "parse_seconds",
    "parse_size",
    "pool_size",
    "timeout_after",
]

#: A plain SQL identifier: ASCII letter or ``_`` first, then letters, digits and ``_``;
#: at most 63 characters (PostgreSQL's limit; MySQL allows 64).
IDENTIFIER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
#: The most UTF-8 bytes of an owner id (the core makes 32-character hex ids).
MAX_OWNER_BYTES = 255

#: A lease as the renewal batcher knows it: (name, owner, token).
Key = tuple[str, str, int]


def check_identifier(what: str, value: object) -> str:
    """Validate a table, schema or channel name; it is quoted as well wherever it is used.

    :raises InvalidArgument: unless all of ``value`` matches :data:`IDENTIFIER_RE`
    """
    if not isinstance(value, str) or not IDENTIFIER_RE.fullmatch(value):
        raise InvalidArgument(
            f"{what} must be a plain SQL identifier matching {IDENTIFIER_RE.pattern} "
            f"(ASCII letters, digits, _), got {value!r}"
        )
    return value


def check_owner(owner: str) -> bytes:
    """The owner id as UTF-8 bytes.

    :raises InvalidArgument: the owner is empty, contains NUL or exceeds 255 bytes
    """
    raw = owner.encode("utf-8")
    if not raw or b"\x00" in raw or len(raw) > MAX_OWNER_BYTES:
        raise InvalidArgument(f"owner id must be 1-{MAX_OWNER_BYTES} bytes without NUL")
    return raw


def encode_metadata(metadata: Mapping[str, str]) -> str:
    """Metadata as the JSON text stored in the row (keys sorted, unicode kept)."""
    return json.dumps(dict(metadata), ensure_ascii=False, sort_keys=True)


# -- URL options ---------------------------------------------------------------------------


def parse_bool(value: str) -> bool:
    """``true/false``, ``yes/no``, ``on/off``, ``1/0`` (any case).

    :raises ValueError: anything else
    """
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def parse_seconds(value: str) -> float:
    """A URL option in seconds (finite, >= 0).

    :raises InvalidArgument: anything else
    """
    return check_seconds("option", float(value), allow_zero=True)


def parse_count(value: str) -> int:
    """A URL option that counts (an int >= 1).

    :raises InvalidArgument: anything else
    """
    return check_count("option", int(value))


def parse_size(value: str) -> int:
    """A URL option that may be zero (an int >= 0).

    :raises InvalidArgument: anything else
    """
    number = int(value)
    if number < 0:
        raise InvalidArgument(f"expected an int >= 0, got {value!r}")
    return number


def parse_query(
    query: str, known: Mapping[str, Callable[[str], Any]], *, what: str, keep_unknown: bool
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Split a URL query into our options (converted) and the rest.

    :param known: option name -> its parser (:func:`parse_bool`, :func:`parse_seconds`, ...)
    :param keep_unknown: return unknown options (for the driver) instead of rejecting them
    :raises InvalidArgument: a malformed query, a repeated or (unless kept) unknown
        option, or a value that does not parse
    """
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise InvalidArgument(f"{what} URL has a malformed query: {exc}") from None
    ours: dict[str, Any] = {}
    rest: list[tuple[str, str]] = []
    for key, value in pairs:
        convert = known.get(key)
        if convert is None:
            if not keep_unknown:
                raise InvalidArgument(
                    f"unknown {what} URL option {key!r}; known: {', '.join(sorted(known))}"
                )
            rest.append((key, value))
            continue
        if key in ours:
            raise InvalidArgument(f"{what} URL option {key!r} is given twice")
        try:
            ours[key] = convert(value)
        except (ValueError, InvalidArgument):
            raise InvalidArgument(f"{what} URL option {key}={value!r} is malformed") from None
    return ours, rest


def pool_size(min_size: object, max_size: object) -> tuple[int, int]:
    """:raises InvalidArgument: unless ``0 <= min_size <= max_size`` and ``max_size >= 1``"""
    for what, value in (("min_size", min_size), ("max_size", max_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgument(f"{what} must be an int >= 0, got {value!r}")
    assert isinstance(min_size, int) and isinstance(max_size, int)
    if max_size < max(min_size, 1):
        raise InvalidArgument(f"max_size ({max_size}) must be >= 1 and >= min_size ({min_size})")
    return min_size, max_size


# -- asyncio helpers and wake-ups ------------------------------------------------------------


#: Seconds a cancelled caller still waits for its statement that may grant a lease.
FINISH_GRACE = 5.0


async def finished(statement: Awaitable[T], grace: float | None = None) -> T:
    """Await ``statement`` (one that may grant a lease) to its end even if the caller is
    cancelled meanwhile (for at most ``grace`` more seconds, default
    :data:`FINISH_GRACE`), then re-raise the cancellation (see
    :func:`~aiolease.backends._asyncio.run_to_end`).

    Interrupting the statement at once would only close its connection: the server
    still runs it to its commit, possibly *after* the compensating release that the
    cancelled caller sends next on another connection, and the grant would stay held
    until its ttl ran out.
    """
    return await run_to_end(statement, FINISH_GRACE if grace is None else grace)


#: A backend object deletes expired entries of its waiters table (PostgreSQL, MySQL)
#: at most this often: its first wait in a queue does, then one every so often.
SWEEP_EVERY = 60.0
#: Entries that expired at least this long ago are deleted (one that just expired may
#: still be read by a statement in flight), ...
SWEEP_AFTER = 1.0
#: ... at most this many per sweep.
SWEEP_LIMIT = 1000


class Sweeps:
    """When a backend object next sweeps its waiters table of expired entries.

    Entries of waiters that died (or were cut off past :data:`FINISH_GRACE`) expire
    but are never deleted by their owners, and a name nobody queues for again has no
    statement that deletes them: the sweeps keep the table to its live entries and
    those of the last :data:`SWEEP_EVERY` seconds.
    """

    def __init__(self, every: float = SWEEP_EVERY) -> None:
        self._every = every
        self._next = -math.inf

    def due(self) -> bool:
        """Whether to sweep now (then not again for :data:`SWEEP_EVERY` seconds)."""
        at = now()
        if at < self._next:
            return False
        self._next = at + self._every
        return True


@dataclass
class _Waiters:
    event: asyncio.Event = field(default_factory=asyncio.Event)
    count: int = 0


class Wakeups:
    """Per-name events that wake the tasks waiting in ``wait_changed`` of one backend."""

    def __init__(self) -> None:
        self._waiters: dict[str, _Waiters] = {}

    @contextmanager
    def watching(self, name: str) -> Iterator[asyncio.Event]:
        """An event set by the next :meth:`wake` of ``name`` (or :meth:`wake_all`)."""
        entry = self._waiters.get(name)
        if entry is None:
            entry = self._waiters[name] = _Waiters()
        entry.count += 1
        try:
            yield entry.event
        finally:
            entry.count -= 1
            if entry.count == 0 and self._waiters.get(name) is entry:
                del self._waiters[name]

    def wake(self, name: str) -> None:
        """Wake every task watching ``name``."""
        entry = self._waiters.pop(name, None)
        if entry is not None:
            entry.event.set()

    def wake_all(self) -> None:
        """Wake every watching task (after missed notifications, or on close)."""
        entries, self._waiters = self._waiters, {}
        for entry in entries.values():
            entry.event.set()


# -- takeovers by notification ----------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Taker:
    owner: str
    token: int
    taken: Callable[[LossReason], object]


class Takers:
    """Held leases of one backend that notifications of a takeover end (``on_taken``).

    Notifications carry the token they grant or release, and tokens only grow, so
    a late one is told from a new one by its token alone (the listener receives
    notifications late and in commit order: one that arrives after the grant
    returned may still be older). A holder of token ``t`` is taken by a grant of a
    greater token, or by a release of ``t`` or greater (its own release unsubscribes
    it first, so that is somebody else's, in its name). A notification whose token is
    unknown ends nothing; nor do notifications missed while no listener was up: the
    holder's renewals still confirm ownership every renew interval, so such a loss
    is noticed by the next renewal instead.
    """

    def __init__(self) -> None:
        self._by_name: dict[str, list[_Taker]] = {}

    def __len__(self) -> int:
        return sum(len(takers) for takers in self._by_name.values())

    def add(
        self, name: str, owner: str, token: int, taken: Callable[[LossReason], object]
    ) -> Callable[[], None]:
        """Watch ``owner``'s grant of ``name`` (``token``); call the returned function to stop."""
        taker = _Taker(owner, token, taken)
        self._by_name.setdefault(name, []).append(taker)

        def cancel() -> None:
            takers = self._by_name.get(name)
            if takers is not None and taker in takers:
                takers.remove(taker)
                if not takers:
                    del self._by_name[name]

        return cancel

    def notified(self, name: str, granted_to: str | None, token: int | None) -> None:
        """A notification: ``name``'s ``token`` was granted to ``granted_to`` (``None``:
        released)."""
        takers = self._by_name.get(name)
        if not takers or token is None:
            return
        for taker in list(takers):
            if token > taker.token or (granted_to is None and token == taker.token):
                takers.remove(taker)
                taker.taken(LossReason.STOLEN)
        if not takers and self._by_name.get(name) is takers:
            del self._by_name[name]


# -- batched renewals ------------------------------------------------------------------------

#: A renewal is answered from an earlier statement only if that statement's age plus
#: the lease's longest gap between renew calls stays within this share of the ttl, so
#: the next renewal comes well before the confirmation runs out (the core's margin
#: defaults to a tenth of the ttl).
SHARE_BUDGET = 0.75


@dataclass
class _Renewal:
    """One lease renewed through this backend."""

    ttl: float
    last_call: float
    #: The longest gap seen between two renew calls for it.
    interval: float = 0.0
    #: When the newest statement that renewed it was sent.
    confirmed: float | None = None
    #: The newest confirmation already handed to the caller.
    answered: float = -math.inf


@dataclass
class _Batch:
    items: dict[Key, float] = field(default_factory=dict)
    sending: bool = False
    sent_at: float | None = None
    renewed: frozenset[Key] = frozenset()
    error: Exception | None = None
    cancelled: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


#: Renews ``[(key, ttl), ...]`` in one statement; returns the keys it renewed.
SendBatch = Callable[[Sequence[tuple[Key, float]]], Awaitable[frozenset[Key]]]


class RenewBatcher:
    """Renewals of every lease held through one backend, in one statement per tick.

    A renew call joins the batch that has not been sent yet; its first caller sends it
    once the renew statement in flight (at most one at a time) has returned, so the
    calls that arrive meanwhile share the next statement. Every statement also renews
    the other leases whose holders are still renewing (they asked within half a ttl)
    and that were last renewed more than a sixth of a ttl ago. A later renew call for
    such a lease is answered from that statement, with ``sent_at`` = the time it was
    sent, but only when the statement is newer than the confirmation the caller had
    before (never older), and fresh enough (see :data:`SHARE_BUDGET`). A lease whose
    holder stopped renewing drops out, and a released one at once.

    :param send: renews a batch in one statement
    :param window: seconds the first caller of a batch waits for others to join
    """

    def __init__(self, send: SendBatch, *, window: float = 0.0) -> None:
        self._send_batch = send
        self._window = window
        self._renewals: dict[Key, _Renewal] = {}
        self._open: _Batch | None = None
        self._inflight: _Batch | None = None
        #: Statements sent, and renew calls answered from a statement sent for others.
        self.statements = 0
        self.shared = 0

    def forget(self, name: str, owner: str, token: int | None) -> None:
        """Stop renewing ``owner``'s grant of ``name`` (it was released; any token if ``None``)."""
        if token is not None:
            self._renewals.pop((name, owner, token), None)
            return
        for key in [k for k in self._renewals if k[0] == name and k[1] == owner]:
            del self._renewals[key]

    async def renew(self, key: Key, ttl: float) -> float | None:
        """Renew ``key`` for ``ttl`` seconds.

        :returns: :func:`now` when the confirming statement was sent, or
            ``None`` when the server did not renew it (not the owner any more)
        :raises Exception: what the batch's statement raised (a mapped backend error)
        """
        called = now()
        renewal = self._called(key, ttl, called)
        if self._shareable(renewal, called):
            await asyncio.sleep(0)
            self.shared += 1
            return self._answer(renewal, renewal.confirmed)
        inflight = self._inflight
        if inflight is not None and self._covers(inflight, key, ttl, renewal):
            await inflight.done.wait()
            if not (inflight.error or inflight.cancelled):
                self.shared += 1
                return self._answer(renewal, inflight.sent_at if key in inflight.renewed else None)
        return await self._join(key, ttl, renewal)

    def _called(self, key: Key, ttl: float, at: float) -> _Renewal:
        renewal = self._renewals.get(key)
        if renewal is None or renewal.ttl != ttl:
            renewal = self._renewals[key] = _Renewal(ttl, at)
        else:
            renewal.interval = max(renewal.interval, at - renewal.last_call)
            renewal.last_call = at
        return renewal

    @staticmethod
    def _shareable(renewal: _Renewal, at: float) -> bool:
        confirmed = renewal.confirmed
        return (
            confirmed is not None
            and confirmed > renewal.answered
            and renewal.interval > 0
            and (at - confirmed) + renewal.interval <= SHARE_BUDGET * renewal.ttl
        )

    @staticmethod
    def _covers(batch: _Batch, key: Key, ttl: float, renewal: _Renewal) -> bool:
        sent = batch.sent_at
        return batch.items.get(key) == ttl and sent is not None and sent > renewal.answered

    def _answer(self, renewal: _Renewal, sent_at: float | None) -> float | None:
        if sent_at is not None:
            renewal.answered = max(renewal.answered, sent_at)
        return sent_at

    async def _join(self, key: Key, ttl: float, renewal: _Renewal) -> float | None:
        while True:
            batch = self._open
            if batch is None:
                batch = self._open = _Batch()
            if batch.items.get(key, ttl) != ttl:
                await batch.done.wait()  # one ttl per lease per statement
                continue
            batch.items[key] = ttl
            if batch.sending:
                await batch.done.wait()
            else:
                batch.sending = True
                await self._send(batch)
            if batch.cancelled:
                continue  # its sender was cancelled: send it again (renewal is idempotent)
            if batch.error is not None:
                raise copy.copy(batch.error) from batch.error.__cause__
            return self._answer(renewal, batch.sent_at if key in batch.renewed else None)

    async def _send(self, batch: _Batch) -> None:
        try:
            await asyncio.sleep(self._window)  # at least a checkpoint: let callers join
            while self._inflight is not None:  # one renew statement in flight at a time
                await self._inflight.done.wait()
            if self._open is batch:
                self._open = None
            sent_at = now()
            self._add_due(batch, sent_at)
            self._inflight = batch
            batch.sent_at = sent_at
            self.statements += 1
            batch.renewed = await self._send_batch(list(batch.items.items()))
            self._record(batch)
        except Exception as exc:
            batch.error = exc
            raise
        except BaseException:
            batch.cancelled = True
            raise
        finally:
            if self._open is batch:
                self._open = None
            if self._inflight is batch:
                self._inflight = None
            batch.done.set()

    def _add_due(self, batch: _Batch, at: float) -> None:
        for key, renewal in list(self._renewals.items()):
            if at - renewal.last_call > renewal.ttl:
                del self._renewals[key]  # its holder stopped renewing
            elif key not in batch.items and self._due(renewal, at):
                batch.items[key] = renewal.ttl

    @staticmethod
    def _due(renewal: _Renewal, at: float) -> bool:
        confirmed = renewal.confirmed
        still_renewing = at - renewal.last_call < renewal.ttl / 2
        return still_renewing and confirmed is not None and at - confirmed >= renewal.ttl / 6

    def _record(self, batch: _Batch) -> None:
        assert batch.sent_at is not None
        for key, ttl in batch.items.items():
            renewal = self._renewals.get(key)
            if renewal is None or renewal.ttl != ttl:
                continue
            if key in batch.renewed:
                renewal.confirmed = max(renewal.confirmed or batch.sent_at, batch.sent_at)
            else:
                del self._renewals[key]


@contextmanager
def mapped_errors(
    map_error: Callable[[BaseException], BackendError], driver: str
) -> Iterator[None]:
    """Raise socket errors, timeouts and every error of the ``driver`` package (by its
    module name: a driver's internal errors derive from none of its public ones) as
    ``map_error`` maps them, ``from`` the original; aiolease's own errors pass."""
    try:
        yield
    except BackendError:
        raise
    except (OSError, asyncio.TimeoutError) as exc:
        raise map_error(exc) from exc
    except Exception as exc:
        if type(exc).__module__.startswith(driver):
            raise map_error(exc) from exc
        raise
