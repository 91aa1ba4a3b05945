"""The wire format of :mod:`aiolease.testing.remote`: frames, and how each operation's
arguments, results and errors travel (see that module for the protocol)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio

from .._exceptions import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    InvalidArgument,
    LimitMismatchError,
    LossReason,
    NotOwnerError,
    UnsupportedCapability,
)
from ..abc import Capability, Grant, HolderInfo, PermitHolders, Renewal, RenewResult

logger = logging.getLogger("aiolease.testing.remote")

#: The protocol version exchanged at ``hello`` (2: request ids; 3: ``renew_many``,
#: ``wait_taken`` and the served ``renews_many``; 4: ``update_metadata``; 5: permits).
PROTOCOL = 5
#: The longest line either side accepts, in bytes.
MAX_FRAME = 1 << 20

#: What goes wrong with a connection, as opposed to with the backend behind it.
_IO_ERRORS = (
    OSError,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
    anyio.IncompleteRead,
)
#: The contract's errors that cross the wire, most specific first.
_WIRE_ERRORS: tuple[type[Exception], ...] = (
    NotOwnerError,
    LimitMismatchError,
    InvalidArgument,
    BackendUnavailable,
    BackendTimeout,
    BackendError,
    UnsupportedCapability,
)


class _ProtocolError(ValueError):
    """A message that does not follow the protocol."""


# -- encoding ---------------------------------------------------------------------------


def _frame(message: Mapping[str, Any]) -> bytes:
    # JSON escapes newlines inside strings, so a message is exactly one line.
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def _parse(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise _ProtocolError(f"not a JSON line: {line[:80]!r}") from exc
    if not isinstance(message, dict):
        raise _ProtocolError(f"not a JSON object: {line[:80]!r}")
    return message


def _field(obj: object, key: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    """``obj[key]`` if it is of ``kind`` (``bool`` is never an ``int`` here)."""
    if not isinstance(obj, dict):
        raise _ProtocolError(f"expected an object holding {key!r}, got {obj!r}")
    value = obj.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise _ProtocolError(f"{key!r} must not be a bool")
    if not isinstance(value, kind):
        raise _ProtocolError(f"{key!r} has the wrong type: {value!r}")
    return value


def _seconds(obj: object, key: str) -> float:
    return float(_field(obj, key, (int, float)))


def _maybe_seconds(obj: object, key: str) -> float | None:
    value = _field(obj, key, (int, float), optional=True)
    return None if value is None else float(value)


def _metadata(obj: object) -> dict[str, str]:
    value = _field(obj, "metadata", dict)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _ProtocolError("metadata must map str to str")
    return dict(value)


def _encode_holder(holder: HolderInfo) -> dict[str, Any]:
    return {
        "name": holder.name,
        "owner": holder.owner,
        "identity": holder.identity,
        "token": holder.token,
        "metadata": dict(holder.metadata),
        "remaining": holder.remaining,
    }


def _decode_holder(obj: object) -> HolderInfo:
    return HolderInfo(
        name=_field(obj, "name", str),
        owner=_field(obj, "owner", str),
        identity=_field(obj, "identity", str),
        token=_field(obj, "token", int),
        metadata=_metadata(obj),
        remaining=_maybe_seconds(obj, "remaining"),
    )


def _encode_grant(grant: Grant, received: float) -> dict[str, Any]:
    # A send time the client cannot read, made into "this long before the request came".
    lead = None if grant.sent_at is None else received - grant.sent_at
    return {"token": grant.token, "ttl": grant.ttl, "lead": lead if lead and lead > 0 else None}


def _decode_grant(obj: object, sent_at: float) -> Grant:
    lead = _maybe_seconds(obj, "lead")
    sent_at_here = None if lead is None else sent_at - lead
    return Grant(_field(obj, "token", int), _seconds(obj, "ttl"), sent_at_here)


def _encode_error(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, LimitMismatchError):
        return {
            "type": "LimitMismatchError",
            "message": str(exc),
            "name": exc.name,
            "limit": exc.limit,
            "held_limit": exc.held_limit,
        }
    for kind in _WIRE_ERRORS:
        if isinstance(exc, kind):
            return {"type": kind.__name__, "message": str(exc), "name": getattr(exc, "name", None)}
    logger.warning("the served backend raised %r; reported as BackendError", exc)
    return {"type": "BackendError", "message": f"{type(exc).__name__}: {exc}", "name": None}


def _decode_error(obj: object) -> Exception:
    kind = _field(obj, "type", str)
    message = _field(obj, "message", str)
    if kind == "NotOwnerError":
        return NotOwnerError(_field(obj, "name", str), message)
    if kind == "LimitMismatchError":
        return LimitMismatchError(
            _field(obj, "name", str), _field(obj, "limit", int), _field(obj, "held_limit", int)
        )
    errors = {
        cls.__name__: cls for cls in _WIRE_ERRORS if cls not in (NotOwnerError, LimitMismatchError)
    }
    return errors.get(kind, BackendError)(message)


def _reply_to(request_id: int, line: bytes) -> dict[str, Any]:
    """The reply in ``line``, if it answers request ``request_id``.

    :raises _ProtocolError: not a reply, or a reply to another request
    """
    reply = _parse(line)
    if "id" not in reply:
        raise _ProtocolError(f"a reply without a request id (protocol {PROTOCOL}?): {line[:80]!r}")
    answered = _field(reply, "id", int, optional=True)
    if answered != request_id:
        raise _ProtocolError(f"the reply to request {answered} came to request {request_id}")
    if ("ok" in reply) == ("error" in reply):
        raise _ProtocolError(f"a reply holds either 'ok' or 'error': {line[:80]!r}")
    return reply


def _decode_hello(value: object) -> tuple[frozenset[Capability], float, bool]:
    """The served capabilities, poll interval and :attr:`~Backend.renews_many`."""
    if _field(value, "protocol", int) != PROTOCOL:
        raise _ProtocolError(f"protocol {_field(value, 'protocol', int)}, not {PROTOCOL}")
    try:
        served = frozenset(Capability(c) for c in _field(value, "capabilities", list))
    except ValueError as exc:
        raise _ProtocolError(str(exc)) from None
    return served, _seconds(value, "poll_interval"), _field(value, "renews_many", bool)


def _decode_outcome(value: object, sent_at: float) -> Grant | HolderInfo:
    if isinstance(value, dict) and "grant" in value:
        return _decode_grant(value["grant"], sent_at)
    return _decode_holder(_field(value, "holder", dict))


def encode_permits(permits: PermitHolders | None) -> dict[str, Any] | None:
    """What :meth:`Backend.read_permits` answered, as it travels."""
    if permits is None:
        return None
    return {
        "name": permits.name,
        "limit": permits.limit,
        "holders": [_encode_holder(h) for h in permits.holders],
        "weights": list(permits.weights),
        "waiting": permits.waiting,
    }


def _decode_permits(value: object) -> PermitHolders | None:
    if value is None:
        return None
    holders = tuple(_decode_holder(h) for h in _field(value, "holders", list))
    weights = _field(value, "weights", list)
    if len(weights) != len(holders) or not all(
        isinstance(w, int) and not isinstance(w, bool) for w in weights
    ):
        raise _ProtocolError(f"expected a weight per holder, got {weights!r}")
    return PermitHolders(
        _field(value, "name", str),
        _field(value, "limit", int),
        holders,
        tuple(weights),
        _field(value, "waiting", int),
    )


def _decode_bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise _ProtocolError(f"expected true or false, got {value!r}")
    return value


def _decode_maybe_holder(value: object) -> HolderInfo | None:
    return None if value is None else _decode_holder(value)


def _decode_reason(value: object) -> LossReason:
    try:
        return LossReason(value)
    except ValueError:
        raise _ProtocolError(f"expected a loss reason, got {value!r}") from None


def _decode_none(value: object) -> None:
    if value is not None:
        raise _ProtocolError(f"expected null, got {value!r}")


def _encode_results(results: Sequence[RenewResult], received: float) -> list[dict[str, Any]]:
    """What :meth:`Backend.renew_many` answered: a grant or an error per renewal."""
    return [
        {"error": _encode_error(r)}
        if isinstance(r, Exception)
        else {"grant": _encode_grant(r, received)}
        for r in results
    ]


def _decode_results(value: object, sent_at: float) -> list[RenewResult]:
    if not isinstance(value, list):
        raise _ProtocolError(f"expected a list of renewal results, got {value!r}")
    results: list[RenewResult] = []
    for item in value:
        if isinstance(item, dict) and "grant" in item:
            results.append(_decode_grant(item["grant"], sent_at))
            continue
        error = _decode_error(_field(item, "error", dict))
        if not isinstance(error, (BackendError, NotOwnerError)):
            raise _ProtocolError(f"a renewal cannot fail with {error!r}")
        results.append(error)
    return results


def _decode_renewals(args: object) -> list[Renewal]:
    return [
        (
            _field(r, "name", str),
            _field(r, "owner", str),
            _field(r, "token", int),
            _seconds(r, "ttl"),
        )
        for r in _field(args, "renewals", list)
    ]


#: The arguments of each operation, by name, as they travel.
_PARAMS: dict[str, tuple[str, ...]] = {
    "try_acquire": ("name", "owner", "ttl", "identity", "metadata"),
    "renew": ("name", "owner", "token", "ttl"),
    "renew_many": ("renewals",),
    "release": ("name", "owner", "token"),
    "read": ("name",),
    "wait_changed": ("name", "seen"),
    "wait_taken": ("name", "held"),
    "wait_turn": ("name", "owner", "ttl", "seen"),
    "wait_lost": ("name", "owner", "token"),
    "update_metadata": ("name", "owner", "token", "metadata"),
    "try_acquire_permit": ("name", "owner", "ttl", "identity", "metadata", "limit", "weight"),
    "read_permits": ("name",),
    "wait_permit_turn": ("name", "owner", "ttl", "seen"),
}

#: How each operation's reply becomes its result (given the client's send time).
_DECODERS: dict[str, Callable[[Any, float], Any]] = {
    "try_acquire": _decode_outcome,
    "renew": _decode_grant,
    "renew_many": _decode_results,
    "release": lambda value, _: _decode_bool(value),
    "read": lambda value, _: _decode_maybe_holder(value),
    "wait_changed": lambda value, _: _decode_none(value),
    "wait_taken": lambda value, _: _decode_none(value),
    "wait_turn": lambda value, _: _decode_none(value),
    "wait_lost": lambda value, _: _decode_reason(value),
    "update_metadata": lambda value, _: _decode_none(value),
    "try_acquire_permit": _decode_outcome,
    "read_permits": lambda value, _: _decode_permits(value),
    "wait_permit_turn": lambda value, _: _decode_none(value),
}


def _encode_args(op: str, args: Sequence[Any]) -> dict[str, Any]:
    """The arguments of a call of ``op``, as they travel."""
    encoded: dict[str, Any] = {}
    for key, value in zip(_PARAMS[op], args, strict=True):
        if key == "renewals":
            value = [dict(zip(("name", "owner", "token", "ttl"), r, strict=True)) for r in value]
        elif isinstance(value, HolderInfo):
            value = _encode_holder(value)
        elif isinstance(value, Mapping):
            value = dict(value)
        encoded[key] = value
    return encoded
