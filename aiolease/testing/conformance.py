"""Conformance checks for aiolease backends, runnable without pytest.

Each check is ``async def check_x(factory) -> None``: it opens a backend with
``factory()`` (an async context manager yielding a :class:`~aiolease.abc.Backend`),
exercises one rule of the contract in :mod:`aiolease.abc`, and raises
:class:`AssertionError` with a clear message when the backend breaks it. Checks use
fresh, uniquely prefixed lease names, so a store that already holds data is fine::

    import aiolease
    from aiolease.testing import check_backend

    async def main() -> None:
        await check_backend(lambda: aiolease.open_backend("redis://localhost/0"))

Or one at a time, to see every failure::

    for name, check in CHECKS:
        await check(factory)

The first group exercises the backend operations directly; the second goes through
:class:`~aiolease.AsyncLock` and :class:`~aiolease.Elector`, so it holds for any
backend whatever its wake-up mechanism.
"""

from __future__ import annotations

from ..abc import Capability
from ._api_checks import (
    check_elector_one_leader,
    check_elector_proclaim,
    check_lock_acquire_nowait,
    check_lock_acquire_timeout,
    check_lock_cancel_in_flight,
    check_lock_cancel_while_waiting,
    check_lock_mutual_exclusion,
    check_lock_release_after_takeover,
    check_lock_wakes_on_release,
)
from ._argument_checks import check_bad_arguments_rejected, check_permit_bad_arguments_rejected
from ._backend_checks import (
    check_expiry_allows_takeover,
    check_grant_when_free,
    check_holder_reported,
    check_idempotent_retry,
    check_metadata_round_trip,
    check_names_accepted,
    check_names_independent,
    check_read,
    check_release_owner_checked,
    check_release_without_token,
    check_renew_does_not_revive,
    check_renew_many_answers_each,
    check_renew_requires_owner,
    check_renew_resets,
    check_tokens_increase,
    check_update_metadata,
    check_update_metadata_wakes,
    check_wait_changed_on_release,
    check_wait_changed_prompt,
)
from ._permit_checks import (
    check_permit_expiry_frees,
    check_permit_limit_checked,
    check_permit_limit_checked_after_release,
    check_permit_queued_release_any_token,
    check_permit_release_frees,
    check_permit_renew_after_loss,
    check_permit_retry_keeps_entry,
    check_permit_tokens_increase,
    check_permit_turn_after_release,
    check_permits_within_limit,
    check_rw_fifo,
    check_rw_readers_share,
    check_rw_writer_alone,
    check_semaphore_api,
)
from ._support import BackendFactory, Check

__all__ = [
    "CHECKS",
    "LEASE_ONLY",
    "BackendFactory",
    "Check",
    "check_backend",
    "check_bad_arguments_rejected",
    "check_elector_one_leader",
    "check_elector_proclaim",
    "check_expiry_allows_takeover",
    "check_grant_when_free",
    "check_holder_reported",
    "check_idempotent_retry",
    "check_lock_acquire_nowait",
    "check_lock_acquire_timeout",
    "check_lock_cancel_in_flight",
    "check_lock_cancel_while_waiting",
    "check_lock_mutual_exclusion",
    "check_lock_release_after_takeover",
    "check_lock_wakes_on_release",
    "check_metadata_round_trip",
    "check_names_accepted",
    "check_names_independent",
    "check_permit_bad_arguments_rejected",
    "check_permit_expiry_frees",
    "check_permit_limit_checked",
    "check_permit_limit_checked_after_release",
    "check_permit_queued_release_any_token",
    "check_permit_release_frees",
    "check_permit_renew_after_loss",
    "check_permit_retry_keeps_entry",
    "check_permit_tokens_increase",
    "check_permit_turn_after_release",
    "check_permits_within_limit",
    "check_read",
    "check_release_owner_checked",
    "check_release_without_token",
    "check_renew_does_not_revive",
    "check_renew_many_answers_each",
    "check_renew_requires_owner",
    "check_renew_resets",
    "check_rw_fifo",
    "check_rw_readers_share",
    "check_rw_writer_alone",
    "check_semaphore_api",
    "check_tokens_increase",
    "check_update_metadata",
    "check_update_metadata_wakes",
    "check_wait_changed_on_release",
    "check_wait_changed_prompt",
    "checks_for",
]


def _named(*checks: Check) -> tuple[tuple[str, Check], ...]:
    return tuple((check.__name__.removeprefix("check_"), check) for check in checks)


#: Every check, as ``(name, check)`` pairs, in the order :func:`check_backend` runs them.
CHECKS: tuple[tuple[str, Check], ...] = _named(
    check_grant_when_free,
    check_holder_reported,
    check_idempotent_retry,
    check_renew_resets,
    check_renew_requires_owner,
    check_renew_does_not_revive,
    check_renew_many_answers_each,
    check_release_owner_checked,
    check_release_without_token,
    check_tokens_increase,
    check_read,
    check_expiry_allows_takeover,
    check_wait_changed_on_release,
    check_wait_changed_prompt,
    check_metadata_round_trip,
    check_update_metadata,
    check_update_metadata_wakes,
    check_names_accepted,
    check_names_independent,
    check_bad_arguments_rejected,
    check_lock_mutual_exclusion,
    check_lock_acquire_timeout,
    check_lock_acquire_nowait,
    check_lock_wakes_on_release,
    check_lock_cancel_while_waiting,
    check_lock_cancel_in_flight,
    check_lock_release_after_takeover,
    check_elector_one_leader,
    check_elector_proclaim,
    check_permits_within_limit,
    check_permit_tokens_increase,
    check_permit_limit_checked,
    check_permit_limit_checked_after_release,
    check_permit_expiry_frees,
    check_permit_release_frees,
    check_permit_queued_release_any_token,
    check_permit_renew_after_loss,
    check_permit_turn_after_release,
    check_permit_retry_keeps_entry,
    check_rw_writer_alone,
    check_rw_readers_share,
    check_rw_fifo,
    check_semaphore_api,
    check_permit_bad_arguments_rejected,
)


#: The checks that do not apply to a backend that serves leader election only
#: (:attr:`Capability.ELECTION_ONLY`): those of :class:`~aiolease.AsyncLock`, which
#: refuses such a backend, and those of a per-lease ttl that a renewal resets and
#: that runs out when nobody renews (a session backend of that kind keeps a term for
#: as long as its member lives, whatever ttl a call names).
LEASE_ONLY: frozenset[str] = frozenset(
    {
        "idempotent_retry",
        "renew_resets",
        "renew_does_not_revive",
        "renew_many_answers_each",
        "tokens_increase",
        "expiry_allows_takeover",
        "lock_mutual_exclusion",
        "lock_acquire_timeout",
        "lock_acquire_nowait",
        "lock_wakes_on_release",
        "lock_cancel_while_waiting",
        "lock_cancel_in_flight",
        "lock_release_after_takeover",
    }
)


def checks_for(capabilities: frozenset[Capability]) -> tuple[tuple[str, Check], ...]:
    """The checks of :data:`CHECKS` that apply to a backend with ``capabilities``:
    all of them, except :data:`LEASE_ONLY` for an election-only backend."""
    if Capability.ELECTION_ONLY in capabilities:
        return tuple((name, check) for name, check in CHECKS if name not in LEASE_ONLY)
    return CHECKS


async def check_backend(factory: BackendFactory) -> None:
    """Run every check that applies (:func:`checks_for` the capabilities of a backend
    from ``factory``) on backends from ``factory``; stop at the first failure.

    :param factory: opens a fresh backend: ``lambda: aiolease.open_backend(url)``
    :raises AssertionError: a check failed; the message starts with the check's name
    """
    async with factory() as backend:
        capabilities = backend.capabilities
    for name, check in checks_for(capabilities):
        try:
            await check(factory)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from exc
