"""Conformance checks of the permit contract: semaphores and read-write locks
(``docs/internals/semaphores.md``).

A backend without :attr:`Capability.SEMAPHORE` passes each check by refusing
permits as the contract says: :class:`~aiolease.AsyncSemaphore` and
:class:`~aiolease.AsyncReadWriteLock` raise :class:`UnsupportedCapability` at
construction, and so does :meth:`Backend.try_acquire_permit`.
"""

from __future__ import annotations

import anyio

from .._exceptions import LeaseHeldError, LimitMismatchError, NotOwnerError, UnsupportedCapability
from .._permits import RW_LIMIT, permit_owner
from .._semaphore import AsyncReadWriteLock, AsyncSemaphore
from ..abc import Backend, Capability, Grant, HolderInfo, PermitHolders
from ._support import (
    LONG_TTL,
    PROMPT,
    SHORT_TTL,
    TOLERANCE,
    BackendFactory,
    increasing,
    require,
    task_group,
    unique_name,
    within,
)

__all__ = [
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
    "check_rw_fifo",
    "check_rw_readers_share",
    "check_rw_writer_alone",
    "check_semaphore_api",
]

#: A reader's and a writer's request: (limit, weight).
READER = (RW_LIMIT, 1)
WRITER = (RW_LIMIT, RW_LIMIT)


async def _serves(backend: Backend) -> bool:
    """Whether ``backend`` serves permits; if it does not, require that it refuses them
    as the contract says (so the check passes on it)."""
    if Capability.SEMAPHORE in backend.capabilities:
        return True
    for make in (
        lambda: AsyncSemaphore(backend, "n", limit=2, ttl=LONG_TTL),
        lambda: AsyncReadWriteLock(backend, "n", ttl=LONG_TTL),
    ):
        try:
            make()
        except UnsupportedCapability:
            continue
        raise AssertionError(f"{backend!r} lacks Capability.SEMAPHORE but a permit type took it")
    try:
        await backend.try_acquire_permit("n", permit_owner(), LONG_TTL, "checker", {}, 2, 1)
    except UnsupportedCapability:
        return False
    raise AssertionError(f"{backend!r} lacks Capability.SEMAPHORE but granted a permit")


async def _ask(
    backend: Backend,
    name: str,
    owner: str,
    request: tuple[int, int] = (1, 1),
    ttl: float = LONG_TTL,
) -> Grant | HolderInfo:
    limit, weight = request
    return await backend.try_acquire_permit(name, owner, ttl, "checker", {}, limit, weight)


async def _granted(
    backend: Backend,
    name: str,
    owner: str,
    request: tuple[int, int] = (1, 1),
    ttl: float = LONG_TTL,
) -> Grant:
    result = await _ask(backend, name, owner, request, ttl)
    require(
        isinstance(result, Grant),
        f"permit {request} of {name!r} should be granted, but {result!r} was reported",
    )
    assert isinstance(result, Grant)
    return result


async def _refused(
    backend: Backend, name: str, owner: str, request: tuple[int, int] = (1, 1)
) -> HolderInfo:
    result = await _ask(backend, name, owner, request)
    require(
        isinstance(result, HolderInfo),
        f"permit {request} of {name!r} should be refused, but was granted {result!r}",
    )
    assert isinstance(result, HolderInfo)
    return result


async def _permits(backend: Backend, name: str) -> PermitHolders:
    permits = await backend.read_permits(name)
    require(permits is not None, f"read_permits({name!r}) returned None while permits are held")
    assert permits is not None
    return permits


async def _until_granted(
    backend: Backend, name: str, owner: str, request: tuple[int, int], seconds: float
) -> Grant:
    """Retry as the core does (``wait_permit_turn`` between tries) until granted."""
    with within(seconds, f"a permit of {name!r}"):
        while True:
            result = await _ask(backend, name, owner, request)
            if isinstance(result, Grant):
                return result
            await backend.wait_permit_turn(name, owner, LONG_TTL, result)


async def check_permits_within_limit(factory: BackendFactory) -> None:
    """Never more than ``limit`` permits are granted; the refused ones are queued."""
    async with factory() as backend:
        if not await _serves(backend):
            return
        name = unique_name()
        owners = [permit_owner() for _ in range(5)]
        for owner in owners[:3]:
            await _granted(backend, name, owner, (3, 1))
        for owner in owners[3:]:
            await _refused(backend, name, owner, (3, 1))
        permits = await _permits(backend, name)
        require(permits.limit == 3, f"read_permits reported limit {permits.limit}, not 3")
        held = {holder.owner for holder in permits.holders}
        require(held == set(owners[:3]), f"read_permits reported holders {held!r}")
        require(permits.used == 3, f"3 permits of weight 1 should weigh 3, not {permits.used}")
        require(permits.waiting == 2, f"2 refused requests should wait, not {permits.waiting}")


async def check_permit_tokens_increase(factory: BackendFactory) -> None:
    """Every grant of a name takes a new, larger token: readers, writers and across
    release, as one counter per name."""
    async with factory() as backend:
        if not await _serves(backend):
            return
        name = unique_name()
        tokens: list[int] = []
        readers = [permit_owner() for _ in range(2)]
        for owner in readers:
            tokens.append((await _granted(backend, name, owner, READER)).token)
        for owner, token in zip(readers, tokens, strict=True):
            require(await backend.release(name, owner, token), "release of a reader returned False")
        writer = permit_owner()
        tokens.append((await _granted(backend, name, writer, WRITER)).token)
        again = await _granted(backend, name, writer, WRITER)
        require(again.token == tokens[-1], "a retry by the holder changed its token")
        require(
            await backend.release(name, writer, tokens[-1]), "release of a writer returned False"
        )
        tokens.append((await _granted(backend, name, permit_owner(), READER)).token)
        require(increasing(tokens), f"permit tokens should strictly increase, got {tokens}")


async def check_permit_limit_checked(factory: BackendFactory) -> None:
    """A request with another limit than the held permits' raises
    :class:`LimitMismatchError` and changes nothing; once none is left, any limit goes."""
    async with factory() as backend:
        if not await _serves(backend):
            return
        name, owner = unique_name(), permit_owner()
        granted = await _granted(backend, name, owner, (3, 1))
        for request in ((4, 1), READER):
            try:
                await _ask(backend, name, permit_owner(), request)
            except LimitMismatchError as exc:
                require(exc.name == name, f"LimitMismatchError.name is {exc.name!r}")
                require(
                    (exc.limit, exc.held_limit) == (request[0], 3),
                    f"LimitMismatchError said {exc.limit} against {exc.held_limit}",
                )
            else:
                raise AssertionError(f"limit {request[0]} against held limit 3 was not refused")
        permits = await _permits(backend, name)
        require(
            [h.owner for h in permits.holders] == [owner] and permits.waiting == 0,
            f"a refused limit changed the permits: {permits!r}",
        )
        await backend.release(name, owner, granted.token)
        await _granted(backend, name, permit_owner(), (4, 1))


async def check_permit_limit_checked_after_release(factory: BackendFactory) -> None:
    """A queued request asked again with another limit, after a release (through the
    same backend object) that may have granted it, raises :class:`LimitMismatchError`
    and changes nothing (rule 2: its queue entry, or the permit a release made of it,
    keeps the name's limit); asked with its own limit, it is granted."""
    async with factory() as backend:
        if not await _serves(backend):
            return
        name, holder, waiter = unique_name(), permit_owner(), permit_owner()
        held = await _granted(backend, name, holder, (2, 2))
        await _refused(backend, name, waiter, (2, 1))
        require(await backend.release(name, holder, held.token), "release of a permit failed")
        try:
            await _ask(backend, name, waiter, (3, 1))
        except LimitMismatchError as exc:
            require(
                (exc.limit, exc.held_limit) == (3, 2),
                f"LimitMismatchError said {exc.limit} against {exc.held_limit}",
            )
        else:
            raise AssertionError(
                "a queued request asked again with limit 3 after a release was not refused"
                " (its queue entry, or the permit a release granted it, has limit 2)"
            )
        await _granted(backend, name, waiter, (2, 1))
        permits = await _permits(backend, name)
        require(
            (permits.limit, [h.owner for h in permits.holders]) == (2, [waiter]),
            f"the waiter should hold the only permit, of limit 2: {permits!r}",
        )
        require(await backend.release(name, waiter, None), "release of a permit failed")
        await _granted(backend, name, permit_owner(), (3, 1))


async def check_permit_expiry_frees(factory: BackendFactory) -> None:
    """A permit that is not renewed expires on the server's clock, and frees its slot."""
    async with factory() as backend:
        if not await _serves(backend):
            return
        name, first, second = unique_name(), permit_owner(), permit_owner()
        await _granted(backend, name, first, (1, 1), ttl=SHORT_TTL)
        await _refused(backend, name, second)
        await _until_granted(backend, name, second, (1, 1), SHORT_TTL + PROMPT + TOLERANCE)
        permits = await _permits(backend, name)
        require(
            [h.owner for h in permits.holders] == [second],
            f"after the expiry the holders should be the waiter only: {permits!r}",
        )


async def check_permit_turn_after_release(factory: BackendFactory) -> None:
    """A release between a refusal and the refused owner's ``wait_permit_turn`` is not
    missed: the wait returns promptly (``seen`` is gone), not after a third of the ttl,
    and the retry is granted. The same for a release by a semaphore's other holder,
    and while another request stays queued behind."""
    async with factory() as backend:
        if not await _serves(backend):
            return
        name, holders = unique_name(), [permit_owner(), permit_owner()]
        grants = [await _granted(backend, name, owner, (2, 1)) for owner in holders]
        waiters = [permit_owner(), permit_owner()]
        seen = [await _refused(backend, name, waiter, (2, 1)) for waiter in waiters]
        for owner, granted in zip(holders, grants, strict=True):
            require(await backend.release(name, owner, granted.token), "a release failed")
        for waiter, before in zip(waiters, seen, strict=True):
            with within(PROMPT, f"wait_permit_turn of {name!r} after the holders released"):
                await backend.wait_permit_turn(name, waiter, LONG_TTL, before)
            await _granted(backend, name, waiter, (2, 1))


async def check_permit_release_frees(factory: BackendFactory) -> None:
    """``release`` frees a permit for the next request, once, and only its owner's."""
    async with factory() as backend:
        if not await _serves(backend):
            return
        name, owner = unique_name(), permit_owner()
        granted = await _granted(backend, name, owner)
        require(
            not await backend.release(name, permit_owner(), granted.token),
            "release by another owner freed a permit",
        )
        require(
            not await backend.release(name, owner, granted.token + 1),
            "release with another token freed a permit",
        )
        stranger = permit_owner()
        await _refused(backend, name, stranger)
        require(
            not await backend.release(name, stranger, None),
            "release of a queued request (the undo of a cancelled wait) freed a permit",
        )
        require(
            await backend.release(name, owner, granted.token),
            "release of a held permit returned False",
        )
        require(
            not await backend.release(name, owner, granted.token),
            "a second release of a permit freed it again",
        )
        await _granted(backend, name, permit_owner())


async def check_permit_queued_release_any_token(factory: BackendFactory) -> None:
    """``release`` by an owner that is only queued drops its queue entry whatever
    ``token`` it names (the holder's, or one never granted), frees no permit, and
    leaves the holder's permit alone: the next request after the holder's release is
    granted at once, not held up behind a request that gave up."""
    async with factory() as backend:
        if not await _serves(backend):
            return
        name, holder = unique_name(), permit_owner()
        granted = await _granted(backend, name, holder)
        queued = [permit_owner(), permit_owner()]
        for owner in queued:
            await _refused(backend, name, owner)
        tokens = (granted.token, granted.token + 1_000_000)
        for owner, token in zip(queued, tokens, strict=True):
            require(
                not await backend.release(name, owner, token),
                f"release of a queued request with token {token} freed a permit",
            )
        permits = await _permits(backend, name)
        require(
            [h.owner for h in permits.holders] == [holder],
            f"a queued request's release changed the permits held: {permits!r}",
        )
        require(
            permits.waiting == 0,
            f"release with a token left {permits.waiting} queue entries of requests"
            " that gave up (the owner's queue entry goes whatever the token)",
        )
        require(await backend.release(name, holder, granted.token), "the holder's release failed")
        await _granted(backend, name, permit_owner())


async def check_permit_renew_after_loss(factory: BackendFactory) -> None:
    """Renewing a permit that is gone (released, expired, or another's) raises
    :class:`NotOwnerError` and brings nothing back; a held one is renewed."""
    async with factory() as backend:
        if not await _serves(backend):
            return
        name, owner, short = unique_name(), permit_owner(), permit_owner()
        granted = await _granted(backend, name, owner, (2, 1))
        renewed = await backend.renew(name, owner, granted.token, LONG_TTL)
        require(renewed.token == granted.token, "renew changed a permit's token")
        released = await _granted(backend, name, short, (2, 1), ttl=SHORT_TTL)
        # The slot the short permit frees at its expiry goes to a waiter.
        waiter = permit_owner()
        await _until_granted(backend, name, waiter, (2, 1), SHORT_TTL + PROMPT + TOLERANCE)
        cases = ((short, released.token, "after expiry"), (permit_owner(), 1, "by a stranger"))
        for who, token, why in cases:
            try:
                await backend.renew(name, who, token, LONG_TTL)
            except NotOwnerError as exc:
                require(exc.name == name, f"NotOwnerError.name is {exc.name!r}")
            else:
                raise AssertionError(f"renew of a permit {why} should raise NotOwnerError")
        await backend.release(name, waiter, (await _permits(backend, name)).holders[-1].token)
        await backend.release(name, owner, granted.token)
        try:
            await backend.renew(name, owner, granted.token, LONG_TTL)
        except NotOwnerError:
            pass
        else:
            raise AssertionError("renew of a released permit should raise NotOwnerError")
        require(await backend.read_permits(name) is None, "a refused renew revived a permit")


async def check_permit_retry_keeps_entry(factory: BackendFactory) -> None:
    """A queued request retried with another weight, and refused, keeps its place in
    the queue and the weight it first asked with (rule 4): the requests behind it
    still count that weight ahead of theirs. Applies to a backend with
    :attr:`Capability.PERMIT_RETRY_KEEPS_ENTRY` (ZooKeeper, where a node's weight is
    in its name, takes such a retry for a new request at the back of the queue)."""
    async with factory() as backend:
        if not await _serves(backend):
            return
        if Capability.PERMIT_RETRY_KEEPS_ENTRY not in backend.capabilities:
            return
        name, holder, first, behind = unique_name(), permit_owner(), permit_owner(), permit_owner()
        held = await _granted(backend, name, holder, (3, 2))
        await _refused(backend, name, first, (3, 3))  # queued, weight 3
        await _refused(backend, name, behind, (3, 1))  # queued behind it
        await _refused(backend, name, first, (3, 2))  # a retry with weight 2: 2 + 2 > 3
        waiting = (await _permits(backend, name)).waiting
        require(waiting == 2, f"a retry of a queued request made {waiting} queue entries, not 2")
        require(await backend.release(name, holder, held.token), "release of a permit failed")
        # Nothing held (or `first`, granted by the release on a backend that grants
        # there): `behind` fits only if the entry ahead of it weighs 2 (rewritten by the
        # retry) or stands behind it (the retry taken for a new request).
        result = await _ask(backend, name, behind, (3, 1))
        require(
            isinstance(result, HolderInfo),
            "the request queued behind a retried one was granted: the retry "
            + "rewrote its entry's weight (3 to 2) or lost its place",
        )
        granted = await _granted(backend, name, first, (3, 3))
        await _refused(backend, name, behind, (3, 1))
        require(await backend.release(name, first, granted.token), "release of a permit failed")
        await _granted(backend, name, behind, (3, 1))


async def check_rw_writer_alone(factory: BackendFactory) -> None:
    """A writer excludes readers and other writers, and waits for readers."""
    async with factory() as backend:
        if not await _serves(backend):
            return
        name, writer = unique_name(), permit_owner()
        granted = await _granted(backend, name, writer, WRITER)
        await _refused(backend, name, permit_owner(), READER)
        await _refused(backend, name, permit_owner(), WRITER)
        await backend.release(name, writer, granted.token)
        name = unique_name()
        await _granted(backend, name, permit_owner(), READER)
        await _refused(backend, name, permit_owner(), WRITER)


async def check_rw_readers_share(factory: BackendFactory) -> None:
    """Readers hold a name together."""
    async with factory() as backend:
        if not await _serves(backend):
            return
        name = unique_name()
        for _ in range(3):
            await _granted(backend, name, permit_owner(), READER)
        require(len((await _permits(backend, name)).holders) == 3, "3 readers should hold it")


async def check_rw_fifo(factory: BackendFactory) -> None:
    """A reader that arrives after a waiting writer waits for it (writers never starve);
    the writer gets in when the readers before it left."""
    async with factory() as backend:
        if not await _serves(backend):
            return
        name, first, writer, late = unique_name(), permit_owner(), permit_owner(), permit_owner()
        reading = await _granted(backend, name, first, READER)
        await _refused(backend, name, writer, WRITER)
        await _refused(backend, name, late, READER)
        await backend.release(name, first, reading.token)
        writing = await _granted(backend, name, writer, WRITER)
        await _refused(backend, name, late, READER)
        await backend.release(name, writer, writing.token)
        last = await _granted(backend, name, late, READER)
        require(reading.token < writing.token < last.token, "tokens follow the order of grants")


async def check_semaphore_api(factory: BackendFactory) -> None:
    """``async with AsyncSemaphore`` admits at most ``limit`` tasks at once, each with a
    token of its own; ``acquire_nowait`` is refused when it is full."""
    async with factory() as backend:
        if not await _serves(backend):
            return
        sem = AsyncSemaphore(backend, unique_name(), limit=2, ttl=LONG_TTL)
        inside, peak, tokens = 0, 0, []
        full, checked = anyio.Event(), anyio.Event()

        async def body() -> None:
            nonlocal inside, peak
            async with sem as permit:
                tokens.append(permit.token)
                inside += 1
                peak = max(peak, inside)
                if inside == 2:
                    full.set()
                # The first two stay in until acquire_nowait was refused; later ones
                # pass through (after a checkpoint, where another could come in).
                await checked.wait()
                await anyio.lowlevel.checkpoint()
                inside -= 1

        with within(2 * PROMPT + 4 * backend.poll_interval, "four permits of limit 2"):
            async with task_group() as tg:
                for _ in range(4):
                    tg.start_soon(body)
                await full.wait()
                try:
                    await sem.acquire_nowait()
                except LeaseHeldError:
                    pass
                else:
                    raise AssertionError("acquire_nowait of a full semaphore was granted")
                finally:
                    checked.set()
        require(peak == 2, f"a semaphore of limit 2 admitted {peak} at once")
        require(len(set(tokens)) == 4, f"4 permits should have 4 tokens, got {tokens}")
        require(await backend.read_permits(sem.name) is None, "the permits were not released")
