"""Conformance checks at the backend level: the contract of :mod:`aiolease.abc`."""

from __future__ import annotations

from collections.abc import Mapping

import anyio

from .._checked import HeldRenewals
from .._exceptions import NotOwnerError, UnsupportedCapability
from ..abc import Backend, Capability, Grant, HolderInfo
from ._support import (
    LONG_TTL,
    PROMPT,
    SHORT_TTL,
    TOLERANCE,
    BackendFactory,
    grant,
    holder_of,
    increasing,
    new_owner,
    refused,
    require,
    require_remaining,
    task_group,
    unique_name,
    wait_free,
    within,
)

# -- try_acquire ------------------------------------------------------------------------


async def check_grant_when_free(factory: BackendFactory) -> None:
    """A free name is granted; ``read`` then reports the grant."""
    async with factory() as backend:
        name, owner = unique_name(), new_owner()
        require(await backend.read(name) is None, f"a never-used name {name!r} should read as free")
        granted = await grant(backend, name, owner, identity="host-a")
        holder = await holder_of(backend, name)
        require(holder.name == name, f"read({name!r}) reported name {holder.name!r}")
        require(holder.owner == owner, f"read reported owner {holder.owner!r}, not the grantee")
        require(holder.identity == "host-a", f"read reported identity {holder.identity!r}")
        require(holder.token == granted.token, f"read token {holder.token} != {granted.token}")


async def check_holder_reported(factory: BackendFactory) -> None:
    """A held name is refused to another owner, with the holder's details, unchanged."""
    async with factory() as backend:
        name, owner = unique_name(), new_owner()
        granted = await grant(backend, name, owner, identity="holder-a", metadata={"role": "a"})
        holder = await refused(backend, name, new_owner())
        require(holder.owner == owner, f"refusal named owner {holder.owner!r}, not the holder")
        require(holder.identity == "holder-a", f"refusal named identity {holder.identity!r}")
        require(holder.token == granted.token, f"refusal token {holder.token} != {granted.token}")
        require(dict(holder.metadata) == {"role": "a"}, f"refusal metadata {holder.metadata!r}")
        after = await holder_of(backend, name)
        require(
            (after.owner, after.token) == (owner, granted.token),
            "a refused try_acquire changed the holder",
        )


async def check_idempotent_retry(factory: BackendFactory) -> None:
    """A retry by the holder returns the same token and resets (not extends) the expiry."""
    async with factory() as backend:
        name, owner = unique_name(), new_owner()
        first = await grant(backend, name, owner, ttl=LONG_TTL)
        again = await grant(backend, name, owner, ttl=1.0)
        require(again.token == first.token, f"retry changed the token {first.token}->{again.token}")
        await require_remaining(backend, name, 0.0, 1.0)
        longer = await grant(backend, name, owner, ttl=LONG_TTL)
        require(longer.token == first.token, "a second retry changed the token")
        await require_remaining(backend, name, 1.0 + TOLERANCE, LONG_TTL)


# -- renew --------------------------------------------------------------------------


async def check_renew_resets(factory: BackendFactory) -> None:
    """``renew`` sets the expiry to now + ttl: it can shorten, and never adds up."""
    async with factory() as backend:
        name, owner = unique_name(), new_owner()
        granted = await grant(backend, name, owner, ttl=LONG_TTL)
        renewed = await backend.renew(name, owner, granted.token, 1.0)
        require(renewed.token == granted.token, "renew changed the token")
        await require_remaining(backend, name, 0.0, 1.0)
        await backend.renew(name, owner, granted.token, 1.0)
        await require_remaining(backend, name, 0.0, 1.0)
        await backend.renew(name, owner, granted.token, LONG_TTL)
        await require_remaining(backend, name, 1.0 + TOLERANCE, LONG_TTL)


async def _expect_not_owner(backend: Backend, name: str, owner: str, token: int, why: str) -> None:
    try:
        await backend.renew(name, owner, token, LONG_TTL)
    except NotOwnerError as exc:
        require(exc.name == name, f"NotOwnerError.name is {exc.name!r}, not {name!r}")
        return
    raise AssertionError(f"renew of {name!r} {why} should raise NotOwnerError")


async def check_renew_requires_owner(factory: BackendFactory) -> None:
    """``renew`` by a non-owner, or of a free name, raises ``NotOwnerError``."""
    async with factory() as backend:
        name, owner = unique_name(), new_owner()
        granted = await grant(backend, name, owner)
        await _expect_not_owner(backend, name, new_owner(), granted.token, "by a non-owner")
        await _expect_not_owner(backend, unique_name(), owner, granted.token, "of a free name")
        holder = await holder_of(backend, name)
        require(holder.owner == owner, "a refused renew changed the holder")


async def check_renew_does_not_revive(factory: BackendFactory) -> None:
    """An expired grant cannot be renewed, and the failed renew does not bring it back."""
    async with factory() as backend:
        name, owner = unique_name(), new_owner()
        granted = await grant(backend, name, owner, ttl=SHORT_TTL)
        await wait_free(backend, name, SHORT_TTL + 1.0 + TOLERANCE)
        await _expect_not_owner(backend, name, owner, granted.token, "after expiry")
        require(await backend.read(name) is None, "renew after expiry revived the record")


async def check_renew_many_answers_each(factory: BackendFactory) -> None:
    """``renew_many`` answers each renewal as ``renew`` would, in order: a grant for
    the owner's (with the ttl it asks), ``NotOwnerError`` for a free name's; the
    same list renewed again (as the core's scheduler does, tick after tick) is
    answered anew."""
    async with factory() as backend:
        # A name that quoting or splitting could get wrong, in a batch of several.
        a, b, free = unique_name(' "q", {x}\\ \u00e9'), unique_name(), unique_name()
        owner_a, owner_b = new_owner(), new_owner()
        granted_a = await grant(backend, a, owner_a, ttl=LONG_TTL)
        granted_b = await grant(backend, b, owner_b, ttl=LONG_TTL)
        renewals = HeldRenewals()
        renewals.extend(
            [
                (a, owner_a, granted_a.token, LONG_TTL),
                (free, owner_a, granted_a.token, LONG_TTL),
                (b, owner_b, granted_b.token, 1.0),
            ]
        )
        for round_ in ("first", "second"):
            results = list(await backend.renew_many(renewals))
            require(len(results) == 3, f"{round_} renew_many: {len(results)} answers to 3")
            first, gone, last = results
            require(
                isinstance(first, Grant) and first.token == granted_a.token,
                f"{round_} renew_many answered {first!r} for the owner's grant",
            )
            require(
                isinstance(gone, NotOwnerError) and gone.name == free,
                f"{round_} renew_many answered {gone!r} for a free name",
            )
            if round_ == "first":
                require(
                    isinstance(last, Grant) and last.token == granted_b.token,
                    f"renew_many answered {last!r} for the owner's grant",
                )
                await require_remaining(backend, b, 0.0, 1.0)  # its own ttl
                require(await backend.release(b, owner_b, granted_b.token), "release failed")
            else:
                require(
                    isinstance(last, NotOwnerError) and last.name == b,
                    f"renew_many answered {last!r} for a grant released since",
                )
        await require_remaining(backend, a, 1.0 + TOLERANCE, LONG_TTL)


# -- release ------------------------------------------------------------------------


async def check_release_owner_checked(factory: BackendFactory) -> None:
    """Only the owner releases; ``True`` once, then ``False``."""
    async with factory() as backend:
        name, owner = unique_name(), new_owner()
        granted = await grant(backend, name, owner)
        freed = await backend.release(name, new_owner(), granted.token)
        require(freed is False, f"release by another owner returned {freed!r}, expected False")
        holder = await holder_of(backend, name)
        require(holder.owner == owner, "release by another owner freed it")
        require(await backend.release(name, owner, granted.token) is True, "owner release failed")
        require(await backend.read(name) is None, "read shows a holder after release")
        again = await backend.release(name, owner, granted.token)
        require(again is False, f"a second release returned {again!r}, expected False")


async def check_release_without_token(factory: BackendFactory) -> None:
    """``release(token=None)`` frees by owner id alone (the compensating release)."""
    async with factory() as backend:
        name, owner = unique_name(), new_owner()
        await grant(backend, name, owner)
        require(await backend.release(name, new_owner(), None) is False, "a stranger freed it")
        require(await backend.release(name, owner, None) is True, "token=None release failed")
        require(await backend.read(name) is None, "read shows a holder after release")
        require(await backend.release(name, owner, None) is False, "second release returned True")


# -- tokens, read, expiry --------------------------------------------------------------


async def check_tokens_increase(factory: BackendFactory) -> None:
    """Tokens strictly increase across release, expiry and takeover; none is reused."""
    async with factory() as backend:
        name = unique_name()
        tokens: list[int] = []
        first = new_owner()
        tokens.append((await grant(backend, name, first)).token)
        await backend.release(name, first, tokens[-1])
        second = new_owner()
        tokens.append((await grant(backend, name, second)).token)
        await backend.renew(name, second, tokens[-1], SHORT_TTL)
        await wait_free(backend, name, SHORT_TTL + 1.0 + TOLERANCE)
        third = new_owner()
        tokens.append((await grant(backend, name, third)).token)
        await backend.release(name, third, None)
        tokens.append((await grant(backend, name, new_owner())).token)
        require(
            increasing(tokens),
            f"tokens over release, expiry, takeover and release must increase: {tokens}",
        )


async def check_read(factory: BackendFactory) -> None:
    """``read`` is ``None`` when free, else the holder with a remaining ttl in (0, ttl]."""
    async with factory() as backend:
        name, owner = unique_name(), new_owner()
        require(await backend.read(name) is None, "a never-used name reads as held")
        await grant(backend, name, owner, ttl=2.0)
        await require_remaining(backend, name, 0.0, 2.0)
        await backend.release(name, owner, None)
        require(await backend.read(name) is None, "a released name reads as held")


async def check_expiry_allows_takeover(factory: BackendFactory) -> None:
    """After the ttl passes without renewal, another owner gets the name with a new token."""
    async with factory() as backend:
        name, old = unique_name(), new_owner()
        first = await grant(backend, name, old, ttl=SHORT_TTL)
        newcomer = new_owner()
        await _refused_while_fresh(backend, name, newcomer, first, SHORT_TTL)
        await wait_free(backend, name, SHORT_TTL + 1.0 + TOLERANCE)
        second = await grant(backend, name, newcomer)
        require(second.token > first.token, f"takeover token {second.token} <= {first.token}")
        require(await backend.release(name, old, first.token) is False, "expired owner released")
        await _expect_not_owner(backend, name, old, first.token, "by the expired owner")
        require((await holder_of(backend, name)).owner == newcomer, "the new holder was disturbed")


async def _refused_while_fresh(
    backend: Backend, name: str, owner: str, held: Grant, ttl: float
) -> None:
    """``try_acquire`` by ``owner`` is refused if its reply comes before ``held`` expires.

    A reply that comes later (a slow server) may grant: the name had expired by then.
    That grant is released so that the caller sees the name free again.
    """
    result = await backend.try_acquire(name, owner, LONG_TTL, "intruder", {})
    received = anyio.current_time()
    if isinstance(result, HolderInfo):
        return
    started = held.sent_at if held.sent_at is not None else received
    require(
        received >= started + ttl,
        f"try_acquire({name!r}) by another owner {received - started:.3f}s into a "
        f"{ttl}s lease should report the holder, but granted {result!r}",
    )
    await backend.release(name, owner, result.token)


# -- wait_changed ---------------------------------------------------------------------


async def check_wait_changed_on_release(factory: BackendFactory) -> None:
    """A task in ``wait_changed`` returns after another task releases the name."""
    from .faults import FaultyBackend

    async with factory() as inner:
        spy = FaultyBackend(inner)
        push = Capability.PUSH_WAKEUP in inner.capabilities
        ttl = LONG_TTL if push else 1.0
        bound = PROMPT + 2 * inner.poll_interval if push else ttl + 1.0
        name, owner = unique_name(), new_owner()
        await grant(inner, name, owner, ttl=ttl)
        seen = await holder_of(inner, name)
        async with task_group() as tg:
            tg.start_soon(_wait_changed_within, spy, name, seen, bound)
            await spy.wait_called("wait_changed")
            require(await inner.release(name, owner, None), "owner release failed")


async def _wait_changed_within(
    backend: Backend, name: str, seen: HolderInfo | None, bound: float
) -> None:
    with within(bound, f"wait_changed({name!r}) returning after a change"):
        await backend.wait_changed(name, seen)


async def check_wait_changed_prompt(factory: BackendFactory) -> None:
    """``wait_changed`` returns promptly when the record already differs from ``seen``."""
    async with factory() as backend:
        name, owner = unique_name(), new_owner()
        await grant(backend, name, owner)
        seen = await holder_of(backend, name)
        bound = PROMPT + 2 * backend.poll_interval
        await backend.release(name, owner, None)
        await _wait_changed_within(backend, name, seen, bound)
        other = new_owner()
        await grant(backend, name, other)
        await _wait_changed_within(backend, name, seen, bound)
        await _wait_changed_within(backend, name, None, bound)
        await backend.release(name, other, None)


# -- metadata and names ----------------------------------------------------------------

UNICODE_METADATA: Mapping[str, str] = {
    "ключ": "значение",
    "emoji 🔐": "✓ ok",
    "empty": "",
    "json": '{"a": [1, 2], "b": null}',
    "quote'\"\\": "new\nline\ttab",
}


async def check_metadata_round_trip(factory: BackendFactory) -> None:
    """Identity and metadata (unicode keys and values) come back exactly."""
    async with factory() as backend:
        name, owner = unique_name(), new_owner()
        identity = "hôte-ü/1 ☃"
        await grant(backend, name, owner, identity=identity, metadata=UNICODE_METADATA)
        for holder in (await holder_of(backend, name), await refused(backend, name, new_owner())):
            require(holder.identity == identity, f"identity came back as {holder.identity!r}")
            require(
                dict(holder.metadata) == dict(UNICODE_METADATA),
                f"metadata came back as {dict(holder.metadata)!r}",
            )


def _long_name(prefix: str) -> str:
    room = 255 - len(prefix.encode()) - 1
    name = f"{prefix}/{'é' * (room // 2)}{'x' * (room % 2)}"
    require(len(name.encode()) == 255, "the 255-byte name is miscomputed")
    return name


async def check_names_accepted(factory: BackendFactory) -> None:
    """Names of 255 UTF-8 bytes, with unicode, slashes, spaces and dots, work."""
    async with factory() as backend:
        prefix = unique_name()
        names = [
            _long_name(prefix),
            f"{prefix}/日本語/名前",
            f"{prefix}/a/b/c/",
            f"{prefix}/with space/..",
            f"{prefix}/%2F'\";--",
        ]
        for name in names:
            owner = new_owner()
            granted = await grant(backend, name, owner)
            holder = await holder_of(backend, name)
            require(holder.name == name, f"read({name!r}) reported name {holder.name!r}")
            require(holder.owner == owner, f"read({name!r}) reported another owner")
            require(await backend.release(name, owner, granted.token), f"release({name!r}) failed")


async def check_names_independent(factory: BackendFactory) -> None:
    """Different names (prefixes, case) are separate leases."""
    async with factory() as backend:
        prefix = unique_name()
        names = [f"{prefix}/a", f"{prefix}/A", f"{prefix}/a/b", f"{prefix}/a ", prefix]
        owners = {name: new_owner() for name in names}
        for name in names:
            await grant(backend, name, owners[name])
        for name in names:
            holder = await holder_of(backend, name)
            require(holder.owner == owners[name], f"{name!r} is held by the owner of another name")
        await backend.release(names[0], owners[names[0]], None)
        require(await backend.read(names[0]) is None, f"{names[0]!r} still held after release")
        for name in names[1:]:
            holder = await holder_of(backend, name)
            require(holder.owner == owners[name], f"releasing {names[0]!r} disturbed {name!r}")


# -- update_metadata (Capability.PROCLAIM) ----------------------------------------------


async def _not_owner(backend: Backend, name: str, owner: str, token: int, what: str) -> None:
    try:
        await backend.update_metadata(name, owner, token, {"role": "intruder"})
    except NotOwnerError:
        return
    raise AssertionError(f"update_metadata by {what} did not raise NotOwnerError")


async def check_update_metadata(factory: BackendFactory) -> None:
    """``update_metadata`` by the holder changes what ``read`` and a refused
    ``try_acquire`` report, and nothing else (owner, identity, token, expiry); by anyone
    else, or once released, it raises :class:`NotOwnerError` and changes nothing. A
    backend without :attr:`Capability.PROCLAIM` raises :class:`UnsupportedCapability`
    and changes nothing."""
    async with factory() as backend:
        name, owner = unique_name(), new_owner()
        granted = await grant(backend, name, owner, identity="leader-a", metadata={"v": "1"})
        if Capability.PROCLAIM not in backend.capabilities:
            try:
                await backend.update_metadata(name, owner, granted.token, {"v": "2"})
            except UnsupportedCapability:
                after = await holder_of(backend, name)
                require(dict(after.metadata) == {"v": "1"}, "a refused update changed metadata")
                return
            raise AssertionError(
                "update_metadata without Capability.PROCLAIM did not raise UnsupportedCapability"
            )
        await backend.renew(name, owner, granted.token, 2.0)  # shorter: a reset would show
        await backend.update_metadata(name, owner, granted.token, {"v": "2", "url": "ü"})
        await require_remaining(backend, name, 0.0, 2.0)  # no renewal
        intruder = new_owner()
        refusal = await refused(backend, name, intruder)
        await backend.release(name, intruder, None)  # leaves a fair queue, as the core would
        for holder in (await holder_of(backend, name), refusal):
            require(
                (holder.owner, holder.identity, holder.token) == (owner, "leader-a", granted.token),
                f"update_metadata changed the grant: {holder!r}",
            )
            require(
                dict(holder.metadata) == {"v": "2", "url": "ü"},
                f"after update_metadata the holder's metadata reads {dict(holder.metadata)!r}",
            )
        await _not_owner(backend, name, new_owner(), granted.token, "another owner")
        await backend.release(name, owner, None)
        await _not_owner(backend, name, owner, granted.token, "the owner after its release")
        require(await backend.read(name) is None, "update_metadata revived a released name")


async def check_update_metadata_wakes(factory: BackendFactory) -> None:
    """A task in ``wait_changed`` returns after the holder's ``update_metadata`` (at once
    on a push backend, by the seen holder's expiry on a polling one), and then reads
    the new metadata; for a :attr:`Capability.MULTI_PROCESS` backend, the waiter's is
    another backend object (as another process's would be)."""
    async with factory() as inner:
        if Capability.PROCLAIM not in inner.capabilities:
            return  # check_update_metadata covers the refusal
        if Capability.MULTI_PROCESS in inner.capabilities:
            async with factory() as other:
                await _woken_by_update(inner, other)
        else:
            await _woken_by_update(inner, inner)


async def _woken_by_update(backend: Backend, waiter: Backend) -> None:
    from .faults import FaultyBackend

    spy = FaultyBackend(waiter)
    push = Capability.PUSH_WAKEUP in waiter.capabilities
    ttl = LONG_TTL if push else 1.0
    bound = PROMPT + 2 * waiter.poll_interval if push else ttl + 1.0
    name, owner = unique_name(), new_owner()
    granted = await grant(backend, name, owner, ttl=ttl, metadata={"v": "1"})
    seen = await holder_of(waiter, name)
    async with task_group() as tg:
        tg.start_soon(_wait_changed_within, spy, name, seen, bound)
        await spy.wait_called("wait_changed")
        await backend.update_metadata(name, owner, granted.token, {"v": "2"})
    if push:
        after = await holder_of(waiter, name)
        require(dict(after.metadata) == {"v": "2"}, "the woken waiter reads old metadata")
    await backend.release(name, owner, None)
