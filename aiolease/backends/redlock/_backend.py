"""The :class:`RedlockBackend`: acquire, renew, release and read decided by a quorum
(see the package docstring, :mod:`aiolease.backends.redlock`).

Requests go to every instance at once through :mod:`aiolease.backends.redlock._fanout`;
what an instance runs is :mod:`aiolease.backends.redlock._scripts`.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from redis.asyncio import Redis

from ..._exceptions import (
    BackendTimeout,
    BackendUnavailable,
    ForeignDataError,
    InvalidArgument,
    NotOwnerError,
)
from ..._records import state_of
from ..._validate import check_seconds
from ...abc import Backend, Capability, Grant, HolderInfo
from .._asyncio import now, wait_event
from ..redis._shared import DEFAULT_PREFIX, Keys, check_prefix, holder_from, ms
from ._fanout import Fanout, Instance, Outcome, votes
from ._scripts import ACQUIRE, READ, RELEASE, RENEW, UPDATE_METADATA
from ._url import OPTIONS, check_unique, endpoint_of, parse_url

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

__all__ = ["RedlockBackend"]

#: Seconds an instance may take to answer one request (also bounded by the ttl).
DEFAULT_REQUEST_TIMEOUT = 0.5
#: A request's timeout is at most this fraction of the ttl asked for.
REQUEST_FRACTION = 1 / 5
#: ... but a short ttl's requests may take this long (or its whole validity, if shorter).
MIN_REQUEST_TIMEOUT = 0.05
#: Seconds any command may take on a client the backend makes; background clean-up too.
DEFAULT_TIMEOUT = 5.0
DRIFT_FACTOR = 0.01
DRIFT_FLOOR = 0.002
#: After a split vote, a waiter retries after a random delay of up to this many seconds
#: (or a tenth of the ttl, if shorter).
SPLIT_JITTER = 0.05
#: Added to a PTTL before waking for the holder's expiry (PTTL is rounded down).
EXPIRY_SLACK = 0.002
#: How many recent owners the backend remembers (split votes, released owners).
RECENT_OWNERS = 4096
#: Seconds that closing waits for requests and late clean-up (releases) still under
#: way before it cancels them (it then waits for their end, see ``Fanout.drain``).
DRAIN_TIMEOUT = 1.0
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _fraction(what: str, value: object) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidArgument(f"{what} must be a number, got {value!r}") from None
    if not 0 <= number < 0.5 or isinstance(value, bool):
        raise InvalidArgument(f"{what} must be in [0, 0.5), got {value!r}")
    return number


def _refuse_fair(value: object) -> None:
    if value is False or (isinstance(value, str) and value.lower() in _FALSE):
        return
    if value is True or (isinstance(value, str) and value.lower() in _TRUE):
        raise InvalidArgument(
            "Redlock has no fair queue: fair=True is not supported (use the one-server Redis"
            " backend or etcd for first-come, first-served waiters)"
        )
    raise InvalidArgument(f"fair must be a bool, got {value!r}")


class RedlockBackend(Backend):
    """Leases granted by a majority of independent Redis servers (see the module docstring).

    :param clients: one ``redis.asyncio.Redis`` client per instance, each a different
        server; the backend never closes them
    :param prefix: prepended to every key (as the one-server backend's)
    :param fair: only ``False``: Redlock has no queue
    :param request_timeout: seconds one instance may take to answer (acquire and renew
        also use at most a fifth of the ttl)
    :param timeout: seconds a subscription may take to be confirmed, and any request
        at all (late clean-up included)
    :param drift_factor: the clock-drift allowance per second of ttl
    :param drift_floor: seconds of drift allowance added to every grant
    :raises InvalidArgument: no client, a client that is not a ``redis.asyncio.Redis``
        of one server, the same server twice, or a bad option
    """

    capabilities = frozenset(
        {
            Capability.PUSH_WAKEUP,
            Capability.SERVER_TIME,
            Capability.MULTI_PROCESS,
            Capability.PROCLAIM,
        }
    )
    requires_asyncio = True

    def __init__(
        self,
        clients: Sequence[Redis],
        *,
        prefix: str = DEFAULT_PREFIX,
        fair: bool | str = False,
        request_timeout: float | str = DEFAULT_REQUEST_TIMEOUT,
        timeout: float | str = DEFAULT_TIMEOUT,
        drift_factor: float | str = DRIFT_FACTOR,
        drift_floor: float | str = DRIFT_FLOOR,
    ) -> None:
        found: object = clients
        if isinstance(found, (str, bytes)) or not isinstance(found, Sequence):
            raise InvalidArgument(f"clients must be a sequence of clients, not {clients!r}")
        check_unique("RedlockBackend", [endpoint_of(c) for c in clients])
        _refuse_fair(fair)
        self._prefix = check_prefix(prefix)
        self._request_timeout = check_seconds("request_timeout", _number(request_timeout))
        self._timeout = check_seconds("timeout", _number(timeout))
        self._drift_factor = _fraction("drift_factor", drift_factor)
        self._drift_floor = check_seconds("drift_floor", _number(drift_floor), allow_zero=True)
        self._fanout = Fanout([Instance(c, self._timeout, self._timeout) for c in clients])
        self._quorum = len(clients) // 2 + 1
        #: Owners whose latest refusal was a split vote (bounded: see wait_turn).
        self._split: dict[tuple[str, str], float] = {}
        #: Owners released lately: a grant of theirs that arrives late is undone.
        self._ended: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._owns_clients = False
        self._closed = False

    def __repr__(self) -> str:
        places = ",".join(i.where for i in self._fanout.instances)
        return f"<RedlockBackend {places} quorum={self._quorum} prefix={self._prefix!r}>"

    @property
    def quorum(self) -> int:
        """How many instances must agree: a majority."""
        return self._quorum

    @property
    def clients(self) -> list[Redis]:
        """The instances' clients, in order."""
        return [i.client for i in self._fanout.instances]

    @property
    def prefix(self) -> str:
        """The key prefix."""
        return self._prefix

    def drift(self, ttl: float) -> float:
        """The clock-drift allowance of a grant of ``ttl`` seconds."""
        return ttl * self._drift_factor + self._drift_floor

    @classmethod
    async def from_url(cls, url: str, **options: Any) -> Self:
        """Connect to every instance ``url`` names (see the module docstring).

        :param options: the query options, as keyword arguments (not also in the URL)
        :raises InvalidArgument: a malformed URL or option
        :raises BackendUnavailable: fewer than a majority of the instances answer
        """
        parsed = parse_url(url)
        for key in options:
            if key not in OPTIONS or key in parsed.options:
                raise InvalidArgument(f"Redlock option {key!r} is unknown or given twice")
        settings: dict[str, Any] = {**parsed.options, **options}
        timeout = check_seconds("timeout", _number(settings.get("timeout", DEFAULT_TIMEOUT)))
        clients = parsed.clients(timeout)
        try:
            backend = cls(clients, **settings)
            backend._owns_clients = True
            await backend.ping()
        except BaseException:
            await asyncio.shield(_close_clients(clients))
            raise
        return backend

    async def ping(self) -> None:
        """One round trip to every instance.

        :raises BackendUnavailable: fewer than a majority answer
        """
        q = self._quorum
        outcome = await self._run(
            None, lambda i: i.call("PING"), self._timeout, "cancel", lambda o: len(o.replies) >= q
        )
        if len(outcome.replies) < self._quorum:
            raise outcome.error(f"only {len(outcome.replies)} Redlock instance(s) answered PING")

    # -- helpers ---------------------------------------------------------------------

    def _keys(self, name: str) -> Keys:
        return Keys.of(self._prefix, name)

    def _per_request(self, ttl: float) -> float:
        """A fifth of the ttl, but for a short ttl at least what its validity allows up
        to :data:`MIN_REQUEST_TIMEOUT`; never more than ``request_timeout``."""
        floor = min(MIN_REQUEST_TIMEOUT, ttl - self.drift(ttl))
        return min(self._request_timeout, max(ttl * REQUEST_FRACTION, floor))

    async def _run(
        self, name: str | None, request: Any, timeout: float, late: Any, decided: Any = None
    ) -> Outcome[Any]:
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        return await self._fanout.run(
            name, request, timeout, decided or (lambda o: o.waiting == 0), late
        )

    # -- the contract ----------------------------------------------------------------

    async def try_acquire(
        self, name: str, owner: str, ttl: float, identity: str, metadata: Mapping[str, str]
    ) -> Grant | HolderInfo:
        keys = self._keys(name)
        meta = json.dumps(dict(metadata), ensure_ascii=False, sort_keys=True).encode()
        args = (owner, ms(ttl), identity.encode(), meta, keys.channel)
        n, q = len(self._fanout.instances), self._quorum
        abandoned = True
        self._ended.pop((name, owner), None)  # a new attempt by an owner released before

        def late(index: int, reply: Any) -> None:
            # A grant that arrives after the caller gave up, or after the lease was
            # released, is undone on its instance.
            gone = abandoned or (name, owner) in self._ended
            if gone and int(reply[0]) == 1:
                undo = abandoned and int(reply[2]) == 1
                self._fanout.spawn(self._release_on(index, name, owner, undo=undo))

        started = now()
        try:
            outcome = await self._run(
                name,
                lambda i: i.eval(ACQUIRE, (keys.lease, keys.token), *args),
                self._per_request(ttl),
                late,
            )
            elapsed = now() - started
            grants = [int(r[1]) for r in outcome.replies.values() if int(r[0]) == 1]
            refusals = [holder_from(name, r) for r in outcome.replies.values() if int(r[0]) != 1]
            validity = ttl - elapsed - self.drift(ttl)
            foreign = [e for e in outcome.errors.values() if isinstance(e, ForeignDataError)]
            if len(grants) >= q and validity > 0 and not foreign:
                abandoned = False
                token = max(grants)
                return Grant(token, ttl - self.drift(ttl), sent_at=started)
        except BaseException:
            if abandoned:
                # Spawned, not only shielded: closing waits for it even if the caller
                # is cancelled again meanwhile (anyio repeats a cancellation).
                undo = self._fanout.spawn(self._release_all(name, owner, frozenset()))
                await asyncio.shield(undo)
            raise
        fresh = frozenset(
            self._fanout.instances[i] for i, r in outcome.replies.items() if _fresh(r)
        )
        await self._release_all(name, owner, fresh)
        if len(grants) >= q and not foreign:
            raise BackendTimeout(
                f"a majority granted {name!r}, but after {elapsed:.3f}s of a {ttl:g}s ttl no"
                " validity was left; it was released"
            )
        if foreign:  # another program writes under the prefix: a mistake to surface
            raise foreign[0]
        if refusals:
            holder = _most_voted(refusals)
            if sum(1 for h in refusals if h.owner == holder.owner) < q:
                # Nobody won a majority: wait_turn waits for a change or the first of
                # these holders to expire, then retries after a random delay.
                if len(self._split) >= RECENT_OWNERS:  # refused callers that never waited
                    self._split.clear()
                self._split[name, owner] = min(h.remaining or 0.0 for h in refusals)
            return holder
        raise outcome.error(f"acquire of {name!r} reached no majority ({len(grants)} of {n})")

    async def _release_on(self, index: int, name: str, owner: str, *, undo: bool) -> None:
        keys = self._keys(name)
        await self._fanout.instances[index].eval(
            RELEASE, (keys.lease, keys.token), owner, "", keys.channel, _flag(undo)
        )

    async def _release_all(self, name: str, owner: str, fresh: frozenset[Instance]) -> None:
        """Undo a failed acquire on every instance (bounded; errors are left to expiry);
        the ``fresh`` instances, which made a new grant for it, also take its token back."""
        self._split.pop((name, owner), None)
        keys = self._keys(name)
        try:
            await self._run(
                name,
                lambda i: i.eval(
                    RELEASE, (keys.lease, keys.token), owner, "", keys.channel, _flag(i in fresh)
                ),
                self._request_timeout,
                "finish",
            )
        except BackendUnavailable:
            pass  # closed: the keys expire on their own

    async def renew(self, name: str, owner: str, token: int, ttl: float) -> Grant:
        keys = self._keys(name)
        n, q = len(self._fanout.instances), self._quorum
        started = now()
        # Every instance is waited for (up to the timeout), not only a majority, and a
        # late one is left to finish: all instances stay in step while none fails.
        outcome = await self._run(
            name,
            lambda i: i.eval(RENEW, (keys.lease, keys.token), owner, token, ms(ttl)),
            self._per_request(ttl),
            "finish",
        )
        elapsed = now() - started
        confirmed = sum(1 for r in outcome.replies.values() if int(r) == 1)
        if confirmed >= q:
            if ttl - elapsed - self.drift(ttl) <= 0:
                raise BackendTimeout(f"renewal of {name!r} confirmed too late to be valid")
            return Grant(token, ttl - self.drift(ttl), sent_at=started)
        if len(outcome.replies) - confirmed > n - q:
            raise NotOwnerError(name)
        raise outcome.error(f"renewal of {name!r} reached no majority ({confirmed} of {n})")

    async def update_metadata(
        self, name: str, owner: str, token: int, metadata: Mapping[str, str]
    ) -> None:
        """Replace the holder's metadata on every instance that holds its grant; done
        once a majority did. One that fails to reach a majority may leave the new
        metadata on some instances (a read then reports either)."""
        keys = self._keys(name)
        n, q = len(self._fanout.instances), self._quorum
        meta = json.dumps(dict(metadata), ensure_ascii=False, sort_keys=True) if metadata else "{}"
        outcome = await self._run(
            name,
            lambda i: i.eval(
                UPDATE_METADATA, (keys.lease, keys.token), owner, token, meta, keys.channel
            ),
            self._request_timeout,
            "finish",
        )
        confirmed = sum(1 for r in outcome.replies.values() if int(r) == 1)
        if confirmed >= q:
            return
        if len(outcome.replies) - confirmed > n - q:
            raise NotOwnerError(name)
        raise outcome.error(f"metadata of {name!r} reached no majority ({confirmed} of {n})")

    async def release(self, name: str, owner: str, token: int | None) -> bool:
        self._split.pop((name, owner), None)
        self._ended[name, owner] = None
        while len(self._ended) > RECENT_OWNERS:
            self._ended.popitem(last=False)
        keys = self._keys(name)

        outcome = await self._run(
            name,
            lambda i: i.eval(
                RELEASE,
                (keys.lease, keys.token),
                owner,
                "" if token is None else token,
                keys.channel,
                "0",
            ),
            self._request_timeout,
            "finish",
        )
        freed = sum(1 for r in outcome.replies.values() if int(r) == 1)
        if freed >= self._quorum:
            return True
        if freed + len(outcome.errors) + outcome.waiting >= self._quorum:  # it may have been
            raise outcome.error(f"release of {name!r}: {freed} instance(s) confirmed")
        return False

    async def read(self, name: str) -> HolderInfo | None:
        keys = self._keys(name)
        q = self._quorum

        def decided(o: Outcome[Any]) -> bool:
            held = votes(_holders(name, o.replies))
            most = max((len(v) for v in held.values()), default=0)
            return most >= q or (len(o.replies) >= q and most + o.waiting < q)

        outcome = await self._run(
            name,
            lambda i: i.eval(READ, (keys.lease, keys.token)),
            self._request_timeout,
            "cancel",
            decided,
        )
        for error in outcome.errors.values():
            if isinstance(error, ForeignDataError):
                raise error
        for owner, held in votes(_holders(name, outcome.replies)).items():
            if len(held) >= q:
                remaining = sorted((h.remaining or 0.0 for h in held), reverse=True)[q - 1]
                first = max(held, key=lambda h: sum(1 for o in held if _same_grant(o, h)))
                # The q-th highest: a grant's token is the highest of its quorum, and an
                # instance that granted it late (after the quorum) may count further.
                token = sorted((h.token for h in held), reverse=True)[q - 1]
                return HolderInfo(name, owner, first.identity, token, first.metadata, remaining)
        if len(outcome.replies) >= q:
            return None
        raise outcome.error(f"read of {name!r}: fewer than {q} instances answered")

    async def wait_changed(self, name: str, seen: HolderInfo | None) -> None:
        """Return when ``name``'s holder may differ from ``seen``: on a grant or release
        published by any instance, or when the holder's remaining ttl runs out.

        :raises BackendError: fewer than a majority confirmed the subscription, or
            answered the read
        """
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        changed = asyncio.Event()
        watchers = await self._watch(self._keys(name).channel, changed)
        try:
            current = await self.read(name)
            if state_of(current) != state_of(seen):
                return
            timeout = None
            if current is not None and current.remaining is not None:
                timeout = current.remaining + EXPIRY_SLACK
            await wait_event(changed, timeout)
        finally:
            await _stop(watchers)

    async def _watch(self, channel: bytes, changed: asyncio.Event) -> list[asyncio.Task[None]]:
        """Subscribe on every instance; return once a majority confirmed."""
        loop = asyncio.get_running_loop()
        ready = [loop.create_future() for _ in self._fanout.instances]

        async def watch(instance: Instance, confirmed: asyncio.Future[None]) -> None:
            try:
                async with instance.subscriptions.watch(channel) as event:
                    confirmed.set_result(None)
                    await event.wait()
                    changed.set()
                    await asyncio.Event().wait()  # until cancelled
            except Exception as exc:  # noqa: BLE001 - reported through the future
                if not confirmed.done():
                    confirmed.set_exception(exc)
                    confirmed.exception()

        tasks = [
            loop.create_task(watch(i, f))
            for i, f in zip(self._fanout.instances, ready, strict=True)
        ]
        try:
            pending = set(ready)
            deadline = loop.time() + self._timeout
            while pending:
                ok = sum(1 for f in ready if f.done() and f.exception() is None)
                failed = sum(1 for f in ready if f.done() and f.exception() is not None)
                if ok >= self._quorum:
                    return tasks
                if failed > len(ready) - self._quorum or loop.time() >= deadline:
                    break
                _, pending = await asyncio.wait(
                    pending, timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED
                )
            if sum(1 for f in ready if f.done() and f.exception() is None) >= self._quorum:
                return tasks
            errors = [f.exception() for f in ready if f.done() and f.exception() is not None]
            raise BackendUnavailable(
                f"fewer than {self._quorum} Redlock instances confirmed a subscription: {errors}"
            )
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.shield(asyncio.wait(tasks))
            raise

    async def wait_turn(self, name: str, owner: str, ttl: float, seen: HolderInfo) -> None:
        """Wait for a change of the majority's holder. After a split vote (nobody won a
        majority), wait for any grant or release, or until the first of the holders
        that refused expires, then retry after a random delay, as Redlock prescribes."""
        split = self._split.pop((name, owner), None)
        if split is None:
            await self.wait_changed(name, seen)
            return
        if self._closed:
            raise BackendUnavailable(f"{self!r} is closed")
        changed = asyncio.Event()
        watchers = await self._watch(self._keys(name).channel, changed)
        try:
            await wait_event(changed, split + EXPIRY_SLACK)
        finally:
            await _stop(watchers)
        await asyncio.sleep(random.uniform(0, min(SPLIT_JITTER, ttl / 10)))

    async def aclose(self) -> None:
        """Let the requests still under way and late clean-up end (bounded; those whose
        callers stopped waiting too: under trio, one still running when trio-asyncio's
        loop closes would raise its driver's error there), stop listening, and close the
        clients if the backend made them. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await asyncio.shield(self._close())

    async def _close(self) -> None:
        await self._fanout.drain(min(self._timeout, DRAIN_TIMEOUT))
        for instance in self._fanout.instances:
            await instance.subscriptions.aclose()
        if self._owns_clients:
            await _close_clients(self.clients)


def _number(value: object) -> object:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise InvalidArgument(f"expected seconds, got {value!r}") from None
    return value


async def _stop(watchers: Sequence[asyncio.Task[None]]) -> None:
    for task in watchers:
        task.cancel()
    if watchers:
        await asyncio.shield(asyncio.wait(watchers))


def _same_grant(a: HolderInfo, b: HolderInfo) -> bool:
    return a.identity == b.identity and a.metadata == b.metadata


def _flag(value: bool) -> str:
    return "1" if value else "0"


def _fresh(reply: Any) -> bool:
    return int(reply[0]) == 1 and int(reply[2]) == 1


def _holders(name: str, replies: Mapping[int, Any]) -> dict[int, HolderInfo | None]:
    return {i: None if r is None else holder_from(name, r) for i, r in replies.items()}


def _most_voted(holders: Sequence[HolderInfo]) -> HolderInfo:
    by_owner = votes(dict(enumerate(holders)))
    best = max(by_owner.values(), key=len)
    top = max(best, key=lambda h: h.token)
    return top


async def _close_clients(clients: Sequence[Redis]) -> None:
    for client in clients:
        try:
            await client.aclose()
        except Exception:  # noqa: BLE001 - closing is best effort, one client at a time
            pass
