"""Conformance check: a bad name or ttl is refused, and what is held stays held."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import anyio

from .._exceptions import InvalidArgument, LossReason
from .._permits import RW_LIMIT, permit_owner
from .._validate import MAX_TTL
from ..abc import Capability, Grant, HolderInfo
from ._support import (
    LONG_TTL,
    PROMPT,
    BackendFactory,
    grant,
    holder_of,
    new_owner,
    require,
    unique_name,
)

#: Names no operation may take: not a str, empty, with NUL, over 255 bytes, not UTF-8.
BAD_NAMES: tuple[object, ...] = (123, None, b"name", "", "a\x00b", "x" * 10240, "\ud800")
#: ttls no operation may take: over :data:`~aiolease._validate.MAX_TTL`, not finite,
#: not positive, not a number.
BAD_TTLS: tuple[object, ...] = (1e300, MAX_TTL * 2, float("inf"), float("nan"), 0, -1.0, True, "9")

#: Metadata :meth:`~aiolease.abc.Backend.update_metadata` may not take: not a map of
#: str to str, ``None``, or over 4 KiB as JSON.
BAD_METADATA: tuple[object, ...] = (None, [("k", "v")], {"k": 1}, {1: "v"}, {"k": "x" * 5000})

Call = Callable[[], object]


def _ignore(reason: LossReason) -> None:
    """A loss callback that is never meant to be called."""


def _name_calls(
    backend: Any, b: object, owner: str, token: int, held: HolderInfo
) -> list[tuple[str, Call]]:
    """Every contract operation on the name ``b``, as ``(description, call)``.

    ``backend`` is typed ``Any``: these calls are what a careless caller may send.
    """
    return [
        ("try_acquire", lambda: backend.try_acquire(b, new_owner(), LONG_TTL, "x", {})),
        ("renew", lambda: backend.renew(b, owner, token, LONG_TTL)),
        ("renew_many", lambda: backend.renew_many([(b, owner, token, LONG_TTL)])),
        ("release", lambda: backend.release(b, owner, token)),
        ("read", lambda: backend.read(b)),
        ("wait_changed", lambda: backend.wait_changed(b, None)),
        ("wait_taken", lambda: backend.wait_taken(b, held)),
        ("wait_turn", lambda: backend.wait_turn(b, new_owner(), LONG_TTL, held)),
        ("wait_lost", lambda: backend.wait_lost(b, owner, token)),
        ("hold", lambda: backend.hold(b, owner, token, _ignore)),
        ("on_taken", lambda: backend.on_taken(b, owner, token, _ignore)),
        ("update_metadata", lambda: backend.update_metadata(b, owner, token, {"k": "v"})),
    ]


def _ttl_calls(
    backend: Any, name: str, t: object, owner: str, token: int, held: HolderInfo
) -> list[tuple[str, Call]]:
    """Every contract operation that takes a ttl, with the ttl ``t``."""
    return [
        ("try_acquire by the holder", lambda: backend.try_acquire(name, owner, t, "x", {})),
        ("try_acquire", lambda: backend.try_acquire(unique_name(), new_owner(), t, "x", {})),
        ("renew", lambda: backend.renew(name, owner, token, t)),
        ("renew_many", lambda: backend.renew_many([(name, owner, token, t)])),
        ("wait_turn", lambda: backend.wait_turn(name, new_owner(), t, held)),
    ]


async def _refused(what: str, call: Call) -> None:
    """:raises AssertionError: ``call`` (awaited if it returns an awaitable) does not
    raise :class:`InvalidArgument` at once"""
    try:
        with anyio.fail_after(PROMPT):
            result = call()
            if inspect.isawaitable(result):
                await result
    except InvalidArgument:
        return
    except TimeoutError:
        raise AssertionError(f"{what} waited instead of raising InvalidArgument") from None
    except Exception as exc:
        raise AssertionError(f"{what} raised {exc!r}, not InvalidArgument") from exc
    raise AssertionError(f"{what} returned instead of raising InvalidArgument")


async def _release_now_declines(backend: Any, bad: object, owner: str, token: int) -> None:
    """``release_now`` never raises: with a bad name it returns ``None``."""
    pending = backend.release_now(bad, owner, token)
    if pending is not None:
        with contextlib.suppress(Exception):  # only the None matters here
            await pending
        raise AssertionError(f"release_now({bad!r}) sent a release instead of returning None")


async def check_bad_arguments_rejected(factory: BackendFactory) -> None:
    """Every operation raises :class:`InvalidArgument` for a bad name (not a non-empty
    str of at most 255 UTF-8 bytes without NUL) or ttl (not in (0, 365 days]), and a
    lease held meanwhile keeps its owner, token and expiry."""
    async with factory() as backend:
        name, owner = unique_name(), new_owner()
        granted = await grant(backend, name, owner, ttl=LONG_TTL)
        held = await holder_of(backend, name)
        for bad in BAD_NAMES:
            for what, call in _name_calls(backend, bad, owner, granted.token, held):
                await _refused(f"{what}({bad!r:.20}, ...)", call)
            await _release_now_declines(backend, bad, owner, granted.token)
        for bad in BAD_TTLS:
            for what, call in _ttl_calls(backend, name, bad, owner, granted.token, held):
                await _refused(f"{what} with ttl={bad!r}", call)
        careless: Any = backend  # what a careless caller may send
        for meta in BAD_METADATA:
            await _refused(
                f"update_metadata with metadata {meta!r:.20}",
                functools.partial(careless.update_metadata, name, owner, granted.token, meta),
            )
        after = await holder_of(backend, name)
        require(
            (after.owner, after.token) == (owner, granted.token),
            "a refused call changed the holder of a held lease",
        )
        if after.remaining is not None:
            require(
                after.remaining > LONG_TTL / 2, f"a refused call cut the ttl to {after.remaining}"
            )
        await backend.renew(name, owner, granted.token, LONG_TTL)
        require(await backend.release(name, owner, granted.token), "the held lease was lost")


#: Limits no permit request may name, and weights no request of limit 2 may name.
BAD_LIMITS: tuple[object, ...] = (0, -1, RW_LIMIT + 1, True, 2.0, "2", None)
BAD_WEIGHTS: tuple[object, ...] = (0, -1, 3, True, 1.0, None)


def _permit_calls(backend: Any, name: str, owner: str) -> list[tuple[str, Call]]:
    """Every permit operation with a bad name, ttl, limit or weight, as ``(description,
    call)``; ``name`` has a permit of ``owner`` granted (limit 2). ``backend`` is typed
    ``Any``: these calls are what a careless caller may send."""

    def ask(n: object, o: str, ttl: object, limit: object, weight: object) -> Call:
        return lambda: backend.try_acquire_permit(n, o, ttl, "x", {}, limit, weight)

    def turn(n: object, ttl: object) -> Call:
        return lambda: backend.wait_permit_turn(n, permit_owner(), ttl, None)

    def read(n: object) -> Call:
        return lambda: backend.read_permits(n)

    calls: list[tuple[str, Call]] = []
    for b in BAD_NAMES:
        calls.append(
            (f"try_acquire_permit({b!r:.20}, ...)", ask(b, permit_owner(), LONG_TTL, 2, 1))
        )
        calls.append((f"read_permits({b!r:.20})", read(b)))
        calls.append((f"wait_permit_turn({b!r:.20}, ...)", turn(b, LONG_TTL)))
    for t in BAD_TTLS:
        calls.append((f"try_acquire_permit by the holder, ttl={t!r}", ask(name, owner, t, 2, 1)))
        calls.append((f"try_acquire_permit with ttl={t!r}", ask(name, permit_owner(), t, 2, 1)))
        calls.append((f"wait_permit_turn with ttl={t!r}", turn(name, t)))
    for limit in BAD_LIMITS:
        calls.append(
            (f"try_acquire_permit, limit={limit!r}", ask(name, permit_owner(), LONG_TTL, limit, 1))
        )
    for weight in BAD_WEIGHTS:
        calls.append(
            (
                f"try_acquire_permit, weight={weight!r}",
                ask(name, permit_owner(), LONG_TTL, 2, weight),
            )
        )
    return calls


async def check_permit_bad_arguments_rejected(factory: BackendFactory) -> None:
    """Every permit operation raises :class:`InvalidArgument` for a bad name or ttl (as
    for locks), a limit that is not an int in [1, 2**31 - 1], or a weight that is not an
    int in [1, limit]; a permit held meanwhile keeps its owner, token and expiry, and
    nothing is queued. A backend without :attr:`Capability.SEMAPHORE` passes by
    refusing permits."""
    async with factory() as backend:
        if Capability.SEMAPHORE not in backend.capabilities:
            return  # check_permits_within_limit requires the refusal
        name, owner = unique_name(), permit_owner()
        granted = await backend.try_acquire_permit(name, owner, LONG_TTL, "holder", {}, 2, 1)
        require(isinstance(granted, Grant), f"a first permit of {name!r} was refused: {granted!r}")
        assert isinstance(granted, Grant)
        for what, call in _permit_calls(backend, name, owner):
            await _refused(what, call)
        permits = await backend.read_permits(name)
        require(permits is not None, "a refused call freed a held permit")
        assert permits is not None
        held = [(h.owner, h.token) for h in permits.holders]
        require(
            (permits.limit, held, permits.waiting) == (2, [(owner, granted.token)], 0),
            f"refused calls changed the permits of {name!r}: {permits!r}",
        )
        remaining = permits.holders[0].remaining
        if remaining is not None:
            require(remaining > LONG_TTL / 2, f"a refused call cut the permit's ttl to {remaining}")
        await backend.renew(name, owner, granted.token, LONG_TTL)
        require(await backend.release(name, owner, granted.token), "the held permit was lost")
