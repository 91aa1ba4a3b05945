"""A hypothesis state machine that holds a backend against the memory model.

:func:`make_model_machine` builds a :class:`~hypothesis.stateful.RuleBasedStateMachine`
that applies the same random operations (``try_acquire``, ``renew``, ``release``,
``read`` by a few owners on a few names, and expiry; and, on a backend with
:attr:`~aiolease.abc.Capability.SEMAPHORE`, permits of a semaphore and of a
read-write lock: ``try_acquire_permit``, their renewals and releases,
``read_permits``) to the backend under test and
to a :class:`~aiolease.backends.memory.MemoryBackend`, and requires that they agree:
granted or refused alike, the same holder, identity and metadata, and fencing
tokens in the same order (equal up to a per-name offset when ``exact_tokens``)::

    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test

    machine = make_model_machine(lambda: aiolease.open_backend(url), anyio_backend="trio")
    run_state_machine_as_test(machine, settings=settings(max_examples=20, deadline=None))

Time: a real backend's clock cannot be faked, so every lease gets a ttl that
outlasts a run, and the ``expire`` rule shortens one lease with ``renew`` on both
sides, waits until the real backend lets it go, and advances the model's clock.

Every backend call runs in one task of one event loop (a blocking portal), so a
connection survives across steps, also for backends bridged to asyncio under trio.

Needs hypothesis (``pip install 'aiolease[test]'``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, cast

import anyio
from anyio.abc import TaskStatus
from anyio.from_thread import start_blocking_portal
from anyio.streams.memory import MemoryObjectSendStream
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from .._exceptions import BackendTimeout, LimitMismatchError, NotOwnerError
from .._permits import RW_LIMIT
from ..abc import Backend, Capability, Grant, HolderInfo, PermitHolders
from ..backends.memory import MemoryBackend
from ._support import BackendFactory, require, unique_name, within

__all__ = ["ModelMachine", "make_model_machine"]

T = TypeVar("T")

#: A ttl that outlasts any run: only the ``expire`` rule ends a lease by time.
LONG_TTL = 600.0
#: The ttl the ``expire`` rule shortens a lease to.
EXPIRE_TTL = 0.05
#: How long the real backend may take to let an expired lease go.
EXPIRE_WITHIN = 5.0
OWNERS = ("owner-a", "owner-b", "owner-c")
NAME_SUFFIXES = ("/a", "/b/ü")
#: Permit owners (what :func:`~aiolease.abc.permit_owner` makes), and the requests
#: ``(name suffix, limit, weight)``: a semaphore of limit 2 (and a client that gives
#: it limit 3), a reader and a writer.
PERMIT_OWNERS = ("permit:a", "permit:b", "permit:c", "permit:d")
PERMIT_REQUESTS = (
    ("/sem", 2, 1),
    ("/sem", 3, 1),
    ("/rw", RW_LIMIT, 1),
    ("/rw", RW_LIMIT, RW_LIMIT),
)
METADATA_VALUES = ("", "x", "ü/∂ ✓")

_Call = Callable[[Backend], Awaitable[Any]]


@dataclass
class _Reply:
    done: anyio.Event = field(default_factory=anyio.Event)
    value: Any = None
    error: Exception | None = None


class _Driver:
    """Opens the backend and runs every call on it in one task of a portal's loop."""

    def __init__(self, factory: BackendFactory, anyio_backend: str) -> None:
        self._factory = factory
        self._stack = ExitStack()
        self.portal = self._stack.enter_context(start_blocking_portal(anyio_backend))
        try:
            self._future, self._requests = self.portal.start_task(self._serve)
        except BaseException:
            self._stack.close()
            raise

    async def _serve(
        self, *, task_status: TaskStatus[MemoryObjectSendStream[tuple[_Call, _Reply]]]
    ) -> None:
        send, receive = anyio.create_memory_object_stream[tuple[_Call, _Reply]]()
        async with self._factory() as backend, receive:
            task_status.started(send)
            async for call, reply in receive:
                try:
                    reply.value = await call(backend)
                except Exception as exc:  # handed to the caller, who re-raises it
                    reply.error = exc
                reply.done.set()

    async def _request(self, call: _Call) -> Any:
        reply = _Reply()
        await self._requests.send((call, reply))
        await reply.done.wait()
        if reply.error is not None:
            raise reply.error
        return reply.value

    def call(self, call: Callable[[Backend], Awaitable[T]]) -> T:
        """Run ``call(backend)`` on the backend's task and return its result."""
        return cast(T, self.portal.call(self._request, call))

    def close(self) -> None:
        """Close the backend, then the event loop."""
        try:
            self.portal.call(self._requests.aclose)
            self._future.result()
        finally:
            self._stack.close()


@dataclass(frozen=True)
class _Config:
    factory: BackendFactory
    anyio_backend: str
    exact_tokens: bool
    fixed_weights: bool
    grants_on_release: bool = False


class ModelMachine(RuleBasedStateMachine):
    """Drives the backend under test and the memory model in lockstep.

    Build a concrete machine with :func:`make_model_machine`.
    """

    config: ClassVar[_Config]

    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0
        self.model = MemoryBackend(clock=lambda: self._now)
        self.driver = _Driver(self.config.factory, self.config.anyio_backend)
        prefix = unique_name()
        self.names = [prefix + suffix for suffix in NAME_SUFFIXES]
        #: Per side, the last token granted to (name, owner).
        self.real_tokens: dict[tuple[str, str], int] = {}
        self.model_tokens: dict[tuple[str, str], int] = {}
        #: Per name, model token -> real token, for every token seen.
        self.token_pairs: dict[str, dict[int, int]] = {}
        self.prefix = prefix
        #: Whether the backend serves permits (the permit rules run only then).
        self.permits = self.driver.call(_serves_permits)
        #: Per name, the permit requests refused and not yet granted or released, in
        #: arrival order: owner -> (limit, weight) of the request that queued it.
        self.queued: dict[str, dict[str, tuple[int, int]]] = {}

    def teardown(self) -> None:
        self.driver.close()

    def on_model(self, call: Callable[[Backend], Awaitable[T]]) -> T:
        """Run ``call(model)`` on the portal's loop."""
        return self.driver.portal.call(call, self.model)

    # -- comparing ---------------------------------------------------------------------

    def relate_tokens(self, name: str, real: int, model: int) -> None:
        """Require ``real`` to stand to earlier real tokens as ``model`` to model ones."""
        pairs = self.token_pairs.setdefault(name, {})
        if model in pairs:
            require(pairs[model] == real, f"{name!r}: token {real} where {pairs[model]} expected")
            return
        for seen_model, seen_real in pairs.items():
            require(
                (seen_model < model) == (seen_real < real),
                f"{name!r}: real token {real} is out of order with {seen_real} "
                f"(model {model} vs {seen_model})",
            )
        if self.config.exact_tokens and pairs:
            offset = next(iter(pairs.items()))
            require(
                real - model == offset[1] - offset[0],
                f"{name!r}: real token {real} does not track the model's {model} "
                f"(earlier {offset[1]} for {offset[0]})",
            )
        pairs[model] = real

    def same_holder(self, real: HolderInfo, model: HolderInfo) -> None:
        """Require the same holder on both sides."""
        require(
            (real.name, real.owner, real.identity) == (model.name, model.owner, model.identity),
            f"holder differs: real {real!r}, model {model!r}",
        )
        require(
            dict(real.metadata) == dict(model.metadata),
            f"metadata differs: real {dict(real.metadata)!r}, model {dict(model.metadata)!r}",
        )
        self.relate_tokens(real.name, real.token, model.token)

    def token_of(self, name: str, owner: str) -> tuple[int, int]:
        """The last tokens granted to ``owner`` on ``name`` (0 if never)."""
        key = (name, owner)
        return self.real_tokens.get(key, 0), self.model_tokens.get(key, 0)

    # -- rules -------------------------------------------------------------------------

    @rule(
        index=st.integers(0, len(NAME_SUFFIXES) - 1),
        owner=st.sampled_from(OWNERS),
        value=st.sampled_from(METADATA_VALUES),
    )
    def try_acquire(self, index: int, owner: str, value: str) -> None:
        name = self.names[index]
        metadata: Mapping[str, str] = {"owner": owner, "value": value}
        identity = f"{owner} ✓"
        real = self.driver.call(lambda b: b.try_acquire(name, owner, LONG_TTL, identity, metadata))
        model = self.on_model(lambda b: b.try_acquire(name, owner, LONG_TTL, identity, metadata))
        if isinstance(model, Grant):
            require(isinstance(real, Grant), f"model granted {name!r} to {owner}, real: {real!r}")
            assert isinstance(real, Grant)
            self.relate_tokens(name, real.token, model.token)
            self.real_tokens[name, owner] = real.token
            self.model_tokens[name, owner] = model.token
        else:
            require(isinstance(real, HolderInfo), f"model refused {name!r}, real: {real!r}")
            assert isinstance(real, HolderInfo) and isinstance(model, HolderInfo)
            self.same_holder(real, model)

    @rule(index=st.integers(0, len(NAME_SUFFIXES) - 1), owner=st.sampled_from(OWNERS))
    def renew(self, index: int, owner: str) -> None:
        name = self.names[index]
        real_token, model_token = self.token_of(name, owner)
        real = self._renew_real(name, owner, real_token, LONG_TTL)
        model = self._renew_model(name, owner, model_token, LONG_TTL)
        require(
            isinstance(real, Grant) == isinstance(model, Grant),
            f"renew of {name!r} by {owner}: real {real!r}, model {model!r}",
        )

    def _renew_real(self, name: str, owner: str, token: int, ttl: float) -> Grant | Exception:
        try:
            return self.driver.call(lambda b: b.renew(name, owner, token, ttl))
        except NotOwnerError as exc:
            return exc

    def _renew_model(self, name: str, owner: str, token: int, ttl: float) -> Grant | Exception:
        try:
            return self.on_model(lambda b: b.renew(name, owner, token, ttl))
        except NotOwnerError as exc:
            return exc

    @rule(
        index=st.integers(0, len(NAME_SUFFIXES) - 1),
        owner=st.sampled_from(OWNERS),
        with_token=st.booleans(),
    )
    def release(self, index: int, owner: str, with_token: bool) -> None:
        name = self.names[index]
        real_token, model_token = self.token_of(name, owner) if with_token else (None, None)
        real = self.driver.call(lambda b: b.release(name, owner, real_token))
        model = self.on_model(lambda b: b.release(name, owner, model_token))
        require(real == model, f"release of {name!r} by {owner}: real {real!r}, model {model!r}")

    @rule(index=st.integers(0, len(NAME_SUFFIXES) - 1))
    def read(self, index: int) -> None:
        name = self.names[index]
        real = self.driver.call(lambda b: b.read(name))
        model = self.on_model(lambda b: b.read(name))
        if model is None or real is None:
            require(real is model, f"read({name!r}): real {real!r}, model {model!r}")
            return
        self.same_holder(real, model)
        require(
            real.remaining is None or 0 < real.remaining <= LONG_TTL + 1.0,
            f"read({name!r}) remaining {real.remaining!r} outside (0, {LONG_TTL}]",
        )

    @rule(index=st.integers(0, len(NAME_SUFFIXES) - 1))
    def expire(self, index: int) -> None:
        name = self.names[index]
        holder = self.on_model(lambda b: b.read(name))
        if holder is None:
            return
        owner = holder.owner
        real_token, model_token = self.token_of(name, owner)
        expired = False
        try:
            real = self._renew_real(name, owner, real_token, EXPIRE_TTL)
        except BackendTimeout:
            # A loaded machine answered too late for so short a ttl (Redlock says so of
            # a majority's late confirmation, the ttl already applied): renewed again a
            # little longer; "not the owner" then means it has expired already, which
            # is what this rule is for.
            real = self._renew_real(name, owner, real_token, 4 * EXPIRE_TTL)
            expired = isinstance(real, NotOwnerError)
        require(
            expired or isinstance(real, Grant), f"renew of {name!r} by its holder failed: {real!r}"
        )
        self._renew_model(name, owner, model_token, EXPIRE_TTL)
        self.driver.call(lambda b: _wait_free(b, name))
        self._now += 2 * EXPIRE_TTL

    # -- permits (docs/internals/semaphores.md) ----------------------------------------

    @precondition(lambda self: self.permits)
    @rule(request=st.sampled_from(PERMIT_REQUESTS), owner=st.sampled_from(PERMIT_OWNERS))
    def try_acquire_permit(self, request: tuple[str, int, int], owner: str) -> None:
        suffix, limit, weight = request
        if self.config.fixed_weights and suffix == "/rw":
            weight = 1 if owner in PERMIT_OWNERS[:2] else RW_LIMIT  # two readers, two writers
        name = self.prefix + suffix

        def ask(b: Backend) -> Awaitable[Grant | HolderInfo]:
            return b.try_acquire_permit(
                name, owner, LONG_TTL, owner, {"w": str(weight)}, limit, weight
            )

        real = self._outcome(lambda: self.driver.call(ask))
        model = self._outcome(lambda: self.on_model(ask))
        kinds = (type(real).__name__, type(model).__name__)
        require(
            kinds[0] == kinds[1], f"permit {request} of {name!r}: real {real!r}, model {model!r}"
        )
        if isinstance(model, Grant):
            assert isinstance(real, Grant)
            self.relate_tokens(name, real.token, model.token)
            self.real_tokens[name, owner] = real.token
            self.model_tokens[name, owner] = model.token
            self.queued.get(name, {}).pop(owner, None)
        elif isinstance(model, HolderInfo):
            self.queued.setdefault(name, {}).setdefault(owner, (limit, weight))
        elif isinstance(model, LimitMismatchError):
            assert isinstance(real, LimitMismatchError)
            require(
                (real.limit, real.held_limit) == (model.limit, model.held_limit),
                f"limit mismatch differs: real {real!r}, model {model!r}",
            )

    @staticmethod
    def _outcome(call: Callable[[], T]) -> T | LimitMismatchError:
        try:
            return call()
        except LimitMismatchError as exc:
            return exc

    @precondition(lambda self: self.permits)
    @rule(suffix=st.sampled_from(("/sem", "/rw")), owner=st.sampled_from(PERMIT_OWNERS))
    def renew_permit(self, suffix: str, owner: str) -> None:
        name = self.prefix + suffix
        real_token, model_token = self.token_of(name, owner)
        real = self._renew_real(name, owner, real_token, LONG_TTL)
        model = self._renew_model(name, owner, model_token, LONG_TTL)
        require(
            isinstance(real, Grant) == isinstance(model, Grant),
            f"renew of a permit of {name!r} by {owner}: real {real!r}, model {model!r}",
        )

    @precondition(lambda self: self.permits)
    @rule(
        suffix=st.sampled_from(("/sem", "/rw")),
        owner=st.sampled_from(PERMIT_OWNERS),
        with_token=st.booleans(),
    )
    def release_permit(self, suffix: str, owner: str, with_token: bool) -> None:
        name = self.prefix + suffix
        real_token, model_token = self.token_of(name, owner) if with_token else (None, None)
        real = self.driver.call(lambda b: b.release(name, owner, real_token))
        model = self.on_model(lambda b: b.release(name, owner, model_token))
        require(real == model, f"release of a permit of {name!r}: real {real!r}, model {model!r}")
        dequeued = self.queued.get(name, {}).pop(owner, None) is not None
        if self.config.grants_on_release and (model or dequeued):
            self._granted_on_release(name)

    def _granted_on_release(self, name: str) -> None:
        """A backend whose release (of a permit or queue entry: one that removed nothing
        grants nothing) grants the queue entries that then fit: the model's waiters
        that fit ask again (in arrival order, the first refusal stops it), and the real
        holders must then be the model's, each with a token in step."""
        granted: list[str] = []
        for owner, (limit, weight) in list(self.queued.get(name, {}).items()):

            def ask(
                b: Backend, owner: str = owner, limit: int = limit, weight: int = weight
            ) -> Awaitable[Grant | HolderInfo]:
                meta = {"w": str(weight)}
                return b.try_acquire_permit(name, owner, LONG_TTL, owner, meta, limit, weight)

            model = self.on_model(ask)
            if not isinstance(model, Grant):
                break
            self.model_tokens[name, owner] = model.token
            del self.queued[name][owner]
            granted.append(owner)
        real = self.driver.call(lambda b: b.read_permits(name))
        after = self.on_model(lambda b: b.read_permits(name))
        tokens = {} if real is None else {h.owner: h.token for h in real.holders}
        holders = set() if after is None else {h.owner for h in after.holders}
        for owner in granted:
            require(owner in tokens, f"the release of {name!r} did not grant {owner}: {real!r}")
            self.relate_tokens(name, tokens[owner], self.model_tokens[name, owner])
            self.real_tokens[name, owner] = tokens[owner]
        require(
            set(tokens) == holders,
            f"after the release of {name!r} the real holders are {sorted(tokens)},"
            f" the model's {sorted(holders)}",
        )

    @precondition(lambda self: self.permits)
    @rule(suffix=st.sampled_from(("/sem", "/rw")))
    def read_permits(self, suffix: str) -> None:
        name = self.prefix + suffix
        real = self.driver.call(lambda b: b.read_permits(name))
        model = self.on_model(lambda b: b.read_permits(name))
        if real is None or model is None:
            require(real is model, f"read_permits({name!r}): real {real!r}, model {model!r}")
            return
        require(
            (real.limit, real.waiting, _weights(real))
            == (model.limit, model.waiting, _weights(model)),
            f"read_permits({name!r}): real {real!r}, model {model!r}",
        )
        tokens = {h.owner: h.token for h in real.holders}
        for holder in model.holders:
            self.relate_tokens(name, tokens[holder.owner], holder.token)


def _weights(permits: PermitHolders) -> dict[str, int]:
    """Each holder's weight, by owner."""
    return {h.owner: w for h, w in zip(permits.holders, permits.weights, strict=True)}


async def _serves_permits(backend: Backend) -> bool:
    return Capability.SEMAPHORE in backend.capabilities


async def _wait_free(backend: Backend, name: str) -> None:
    with within(EXPIRE_WITHIN, f"expiry of {name!r} after renew(ttl={EXPIRE_TTL})"):
        while (holder := await backend.read(name)) is not None:
            await backend.wait_changed(name, holder)


def make_model_machine(
    factory: BackendFactory,
    *,
    anyio_backend: str = "asyncio",
    exact_tokens: bool = True,
    fixed_weights: bool = False,
    grants_on_release: bool = False,
) -> type[ModelMachine]:
    """A state machine class that holds backends from ``factory`` against the model.

    :param factory: opens the backend under test (a fresh one per example is fine;
        lease names are unique per example)
    :param anyio_backend: the event loop to run the backend on (``"asyncio"``, ``"trio"``)
    :param exact_tokens: require tokens to equal the model's up to a per-name offset;
        ``False`` for backends whose tokens only increase (e.g. global revisions)
    :param fixed_weights: each permit owner asks a read-write lock with one weight
        (two readers, two writers), as the core always does (an owner id names one
        request); for backends that take a queued request retried with another weight
        for a new request, at the back of the queue (ZooKeeper, where a node's weight
        is in its name), while the model keeps its place
    :param grants_on_release: the backend's release of a permit or queue entry grants
        the queue entries that then fit (PostgreSQL, MySQL / MariaDB), where the model
        leaves them queued until they ask again: the machine has them ask the model
        again after each release, and requires the real release to have granted them
    """
    config = _Config(factory, anyio_backend, exact_tokens, fixed_weights, grants_on_release)
    machine = type(f"ModelMachine_{anyio_backend}", (ModelMachine,), {"config": config})
    return cast("type[ModelMachine]", machine)
