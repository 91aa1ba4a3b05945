"""The argument checks of the backend contract, run before any backend's own code.

:class:`~aiolease.abc.Backend` wraps each contract method that a class defines (its
own defaults and every subclass's overrides) so that a bad lease name or ttl raises
:class:`InvalidArgument` before the backend sees it, as :class:`~aiolease.AsyncLock`
does: nothing is sent, nothing held changes. A backend's code can therefore take
its arguments as valid, and no backend can forget a check.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from ._exceptions import InvalidArgument
from ._permits import RW_LIMIT, check_limit, check_weight
from ._records import Renewal
from ._validate import check_metadata, check_name, check_ttl

__all__ = [
    "HeldRenewals",
    "check_arguments",
    "derived",
    "install",
    "returns_within_ttl",
    "within_ttl",
]

#: Which positional argument (after ``self``) of each method is checked, and how.
_Spec = tuple[tuple[int, str, Callable[[object], object]], ...]


class HeldRenewals(list[Renewal]):
    """The renewals the core's scheduler hands to :meth:`Backend.renew_many`: of leases
    it holds, whose names and ttls were checked when they were granted (so not again
    on every tick; any other sequence is checked).

    The scheduler hands the same list, unchanged, to every call that renews the same
    leases again (a cohort, tick after tick): a backend may keep in :attr:`cache` what
    it derives from the list (its encoded parameters), under a key of its own.
    """

    __slots__ = ("cache",)

    def __init__(self) -> None:
        super().__init__()
        #: What backends derived from these renewals, by a key of each backend's.
        self.cache: dict[str, object] = {}


T = TypeVar("T")


def derived(renewals: Sequence[Renewal], key: str, make: Callable[[Sequence[Renewal]], T]) -> T:
    """``make(renewals)``: made once per :class:`HeldRenewals` list (kept in its
    :attr:`~HeldRenewals.cache` under ``key``, a key of the caller's own), made every
    time for any other sequence (which may change between calls)."""
    if type(renewals) is not HeldRenewals:
        return make(renewals)
    cache = renewals.cache
    if key in cache:
        return cast(T, cache[key])
    value = cache[key] = make(renewals)
    return value


#: The checks of names and ttls, remembered: the core passes the same name to several
#: contract methods per acquisition, and renews every held lease each renew interval.
#: Bounded, so that names used long ago do not stay; a failed check is not kept.
_checked_name = functools.lru_cache(maxsize=32_768)(check_name)
_checked_ttl = functools.lru_cache(maxsize=256)(check_ttl)


def _name(name: object) -> object:
    """:func:`check_name`, remembered for the str names seen recently."""
    return _checked_name(name) if type(name) is str else check_name(name)


def _ttl(ttl: object) -> object:
    """:func:`check_ttl`, remembered for the float ttls seen recently."""
    return _checked_ttl(ttl) if type(ttl) is float else check_ttl(ttl)


def _metadata(metadata: object) -> object:
    """:func:`check_metadata`, which also refuses ``None`` (not a map to publish)."""
    if metadata is None:
        raise InvalidArgument("metadata must be a mapping, not None")
    return check_metadata(metadata)


_NAME: _Spec = ((0, "name", _name),)
SPECS: dict[str, _Spec] = {
    "try_acquire": (*_NAME, (2, "ttl", _ttl)),
    "renew": (*_NAME, (3, "ttl", _ttl)),
    "release": _NAME,
    "read": _NAME,
    "wait_changed": _NAME,
    "wait_taken": _NAME,
    "wait_turn": (*_NAME, (2, "ttl", _ttl)),
    "wait_lost": _NAME,
    "hold": _NAME,
    "on_taken": _NAME,
    "update_metadata": (*_NAME, (3, "metadata", _metadata)),
    "try_acquire_permit": (*_NAME, (2, "ttl", _ttl), (5, "limit", check_limit)),
    "read_permits": _NAME,
    "wait_permit_turn": (*_NAME, (2, "ttl", _ttl)),
}


#: Set on a wrapped method, so that it is not wrapped twice.
_MARK = "__aiolease_checked__"

#: Set on a wait (``wait_turn``, ``wait_permit_turn``) that returns well within the
#: ``ttl`` it is given by itself: the core then waits on it without a cancel scope of
#: its own to make sure of that (one scope less per wait, which a contended
#: acquisition may do many times). Kept by the wrapping (``functools.wraps`` copies
#: the function's attributes); an override in a subclass has it only if marked too.
_WITHIN_TTL = "__aiolease_within_ttl__"

F = TypeVar("F", bound=Callable[..., Any])


def returns_within_ttl(fn: F) -> F:
    """Mark the wait ``fn`` as returning well within its ``ttl`` by itself."""
    setattr(fn, _WITHIN_TTL, True)
    return fn


def within_ttl(wait: Callable[..., Any]) -> bool:
    """Whether the wait ``wait`` (a bound method) is marked :func:`returns_within_ttl`."""
    return getattr(wait, _WITHIN_TTL, False) is True


def check_arguments(method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Check the arguments of a call of the contract method ``method``.

    :raises InvalidArgument: a bad name or ttl
    """
    if method == "renew_many":
        renewals = args[0] if args else kwargs.get("renewals", ())
        if type(renewals) is HeldRenewals:
            return  # the core's, of held leases: checked when they were granted
        for renewal in renewals:
            _name(renewal[0])
            _ttl(renewal[3])
        return
    for index, key, check in SPECS[method]:
        if index < len(args):
            check(args[index])
        elif key in kwargs:
            check(kwargs[key])
    if method == "try_acquire_permit":
        limit = args[5] if len(args) > 5 else kwargs.get("limit")
        weight = args[6] if len(args) > 6 else kwargs.get("weight")
        if isinstance(limit, int):  # checked above (a missing one: the call's TypeError)
            check_weight(weight, limit)


def _checker(method: str) -> Callable[[Sequence[Any], dict[str, Any]], None]:
    """:func:`check_arguments` for ``method``, made for it once: a call passes every
    checked argument by position (as the core does) with no loop over its specs."""
    spec = SPECS.get(method, ())
    if method == "try_acquire_permit":

        def check_permit(args: Sequence[Any], kwargs: dict[str, Any]) -> None:
            if len(args) < 7:  # (not all by position: the general way)
                check_arguments(method, args, kwargs)
                return
            _name(args[0])
            _ttl(args[2])
            limit, weight = args[5], args[6]
            # check_limit and check_weight, for the ints the core passes:
            if type(limit) is not int or type(weight) is not int or not 1 <= limit <= RW_LIMIT:
                check_weight(weight, check_limit(limit))
            elif not 1 <= weight <= limit:
                check_weight(weight, limit)

        return check_permit
    if not spec or spec[0][0] != 0:
        return functools.partial(check_arguments, method)
    if len(spec) == 1:  # the name alone

        def check_name_only(args: Sequence[Any], kwargs: dict[str, Any]) -> None:
            if args:
                _name(args[0])
            elif "name" in kwargs:
                _name(kwargs["name"])

        return check_name_only
    ((_, _, check_second),) = spec[1:]
    second = spec[1][0]

    def check_two(args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        if len(args) > second:
            _name(args[0])
            check_second(args[second])
        else:
            check_arguments(method, args, kwargs)

    return check_two


async def _raise(exc: Exception) -> Any:
    """A coroutine that raises ``exc`` when awaited."""
    try:
        raise exc
    finally:
        del exc  # (no reference cycle through the traceback)


def _mark_coroutine_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, marked for ``inspect.iscoroutinefunction`` where Python can (3.12+): it
    returns a coroutine, as the method it wraps."""
    mark = getattr(inspect, "markcoroutinefunction", None)
    return fn if mark is None else cast(Callable[..., Any], mark(fn))


def _wrap(method: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    check = _checker("release" if method == "release_now" else method)
    if method == "release_now":
        # Must never raise: a bad name gets no early release, and the core's
        # release() that follows raises.
        @functools.wraps(fn)
        def release_now(self: object, *args: Any, **kwargs: Any) -> Any:
            try:
                check(args, kwargs)
            except InvalidArgument:
                return None
            return fn(self, *args, **kwargs)

        wrapped: Callable[..., Any] = release_now
    elif inspect.iscoroutinefunction(fn):
        # Not a coroutine function itself: it checks, then returns the backend's own
        # coroutine (awaited by the caller), so a call is one coroutine, not two run
        # through on every step. What a call raises is raised where it was: at the
        # await of what the call returned.
        @functools.wraps(fn)
        def checked(self: object, *args: Any, **kwargs: Any) -> Any:
            try:
                check(args, kwargs)
                return fn(self, *args, **kwargs)
            except Exception as exc:
                return _raise(exc)

        wrapped = _mark_coroutine_function(checked)
    else:

        @functools.wraps(fn)
        def checked_sync(self: object, *args: Any, **kwargs: Any) -> Any:
            check(args, kwargs)
            return fn(self, *args, **kwargs)

        wrapped = checked_sync
    setattr(wrapped, _MARK, True)
    return wrapped


def install(cls: type) -> None:
    """Wrap the contract methods that ``cls`` itself defines with their checks."""
    for method in (*SPECS, "renew_many", "release_now"):
        fn = cls.__dict__.get(method)
        if inspect.isfunction(fn) and not getattr(fn, _MARK, False):
            setattr(cls, method, _wrap(method, fn))
