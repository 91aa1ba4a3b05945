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
from ._permits import check_limit, check_weight
from ._records import Renewal
from ._validate import check_metadata, check_name, check_ttl

__all__ = ["HeldRenewals", "check_arguments", "derived", "install"]

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
    if method == "try_acquire_permit" or not spec or spec[0][0] != 0:
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

        @functools.wraps(fn)
        async def checked(self: object, *args: Any, **kwargs: Any) -> Any:
            check(args, kwargs)
            return await fn(self, *args, **kwargs)

        wrapped = checked
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
