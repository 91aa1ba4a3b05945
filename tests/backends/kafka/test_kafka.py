"""The Kafka backend against the Tansu broker of ``scripts/services.sh``, under asyncio
and trio: the conformance checks that apply to an election-only backend, names, URLs,
and resigning.

Every test uses group and topic names of its own (a fresh prefix), and 2 s sessions
(a rebalance then costs about 1 s on Tansu).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest

import aiolease
from aiolease import Capability, Elector, InvalidArgument, Lease, UnsupportedCapability
from aiolease.backends.kafka import KafkaBackend
from aiolease.backends.kafka._url import parse_url, settings_of
from aiolease.testing import CHECKS, Check, checks_for
from aiolease.testing._backend_checks import UNICODE_METADATA
from aiolease.testing.conformance import LEASE_ONLY
from tests.backends.kafka.support import SESSION, opener

pytestmark = pytest.mark.anyio

#: Checks that apply to an election-only backend but not to this one, and why; each
#: has a test of its own here that shows the Kafka form of the rule.
NOT_ON_KAFKA = {
    # test_names_outside_kafkas_alphabet_are_refused
    "names_accepted": "names become topic names: ASCII letters, digits, '.', '_', '-' only",
    "names_independent": "its names have '/' and ' ', which topic names cannot have",
    # test_wait_changed_wakes_on_release
    "wait_changed_on_release": "grants with ttl=1 s, shorter than one rebalance on Tansu",
    # test_a_rebalance_ends_the_term_before_the_next_one_starts (both)
    "holder_reported": "another candidate joining is a rebalance, which ends the term",
    "metadata_round_trip": "its refusal comes from another candidate: a rebalance",
}
APPLICABLE = [
    (name, check)
    for name, check in checks_for(KafkaBackend.capabilities)
    if name not in NOT_ON_KAFKA
]


# -- the contract ------------------------------------------------------------------------


def test_the_checks_that_apply_are_chosen_by_capability() -> None:
    """Every check runs, but for those an election-only backend cannot pass (its
    capabilities say so) and the five above, which have Kafka forms below."""
    assert Capability.ELECTION_ONLY in KafkaBackend.capabilities
    left_out = {name for name, _ in CHECKS} - {name for name, _ in APPLICABLE}
    assert left_out == LEASE_ONLY | set(NOT_ON_KAFKA)
    assert checks_for(frozenset()) == CHECKS


@pytest.mark.parametrize("check", [c for _, c in APPLICABLE], ids=[n for n, _ in APPLICABLE])
async def test_conformance(anyio_backend: str, kafka_url: str, check: Check) -> None:
    await check(opener(kafka_url))


async def test_async_lock_is_refused(anyio_backend: str, kafka_url: str) -> None:
    async with opener(kafka_url)() as backend:
        with pytest.raises(UnsupportedCapability, match="election"):
            aiolease.AsyncLock(backend, "x", ttl=5)


async def test_wait_changed_wakes_on_release(anyio_backend: str, kafka_url: str) -> None:
    """The Kafka form of ``wait_changed_on_release``: a ttl longer than a rebalance."""
    async with opener(kafka_url)() as backend:
        elector = Elector(backend, "wakes", ttl=2 * SESSION, identity="a")
        async with elector.leadership() as lease:
            seen = await backend.read("wakes")
            assert seen is not None and (seen.owner, seen.token) == (lease.owner, lease.token)
            async with anyio.create_task_group() as tg:

                async def wait() -> None:
                    with anyio.fail_after(SESSION):
                        await backend.wait_changed("wakes", seen)

                tg.start_soon(wait)
                await elector.resign()
        assert await backend.read("wakes") is None


# -- names and URLs ------------------------------------------------------------------------

BAD_NAMES = ["a/b", "with space", "é", "x" * 250, "semi;colon"]


async def test_names_outside_kafkas_alphabet_are_refused(
    anyio_backend: str, kafka_url: str
) -> None:
    async with opener(kafka_url)() as backend:
        for name in BAD_NAMES:
            with pytest.raises(InvalidArgument, match="Kafka"):
                await backend.read(name)
            with pytest.raises(InvalidArgument, match="Kafka"):
                await backend.try_acquire(name, "owner", 5.0, "me", {})
            with pytest.raises(InvalidArgument, match="Kafka"):
                async with Elector(backend, name, ttl=5).leadership():
                    pass  # pragma: no cover
    async with opener(kafka_url, prefix="")() as bare:
        for name in (".", ".."):
            with pytest.raises(InvalidArgument, match="topic"):
                await bare.read(name)


def test_urls_name_every_broker() -> None:
    parsed = parse_url("kafka://u%40x:p%3Aw@10.0.0.1,h2:9093,[::1]:19092?timeout=2", {})
    assert parsed.endpoints == (("10.0.0.1", 9092), ("h2", 9093), ("::1", 19092))
    assert parsed.user == ("u@x", "p:w")
    assert "p:w" not in parsed.described() and "p:w" not in repr(parsed)
    assert parsed.client_options() == {
        "sasl_plain_username": "u@x",
        "sasl_plain_password": "p:w",
        "sasl_mechanism": "PLAIN",
        "security_protocol": "SASL_PLAINTEXT",
    }
    settings = settings_of({"session_timeout": "10", "heartbeat_interval": 1, "group_prefix": ""})
    assert (settings.session_timeout, settings.heartbeat_interval) == (10.0, 1.0)
    assert settings.group_prefix == "" and settings.topic_prefix == "aiolease."


@pytest.mark.parametrize(
    ("url", "options", "match"),
    [
        ("kafka://", {}, "names no broker"),
        ("kafka://h:notaport", {}, "bad port"),
        ("kafka://h:70000", {}, "out of range"),
        ("kafka://h/path", {}, "no path"),
        ("kafka://h?nosuch=1", {}, "unknown Kafka option"),
        ("kafka://h?timeout=1", {"timeout": 2}, "given in the URL and as arguments"),
        ("kafka://h?session_timeout=0", {}, "session_timeout"),
        ("kafka://h?session_timeout=abc", {}, "not a number"),
        ("kafka://h?session_timeout=2&heartbeat_interval=1.5", {}, "under half"),
        ("kafka://h?group_prefix=a/b", {}, "group_prefix"),
        ("kafka://h?replication_factor=0", {}, "replication_factor"),
        ("kafka://h?ssl_context=x", {}, "keyword argument"),
        ("kafka://u:s3cret@h?nosuch=1", {}, "unknown"),
    ],
)
async def test_bad_urls_are_refused(url: str, options: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match) as caught:
        async with aiolease.open_backend(url, **options):
            pass  # pragma: no cover
    assert "s3cret" not in str(caught.value)


async def test_unreachable_brokers_are_unavailable(anyio_backend: str) -> None:
    with pytest.raises(aiolease.BackendUnavailable, match="127.0.0.1:1") as caught:
        async with aiolease.open_backend("kafka://u:s3cret@127.0.0.1:1?timeout=2"):
            pass  # pragma: no cover
    assert "s3cret" not in str(caught.value)


# -- resigning -------------------------------------------------------------------------------


async def test_resign_hands_on_without_waiting_for_the_session(
    anyio_backend: str, kafka_url: str
) -> None:
    """The leader leaves the group at once: the other candidate leads well within the
    session timeout (4 s here; a rebalance on Tansu takes half of it); a backend
    outside the group reads the leader from the broker; tokens increase. (The second
    candidate's joining is a rebalance: the first leads again in a new term first.)"""
    open_ = opener(kafka_url, session_timeout=4.0, heartbeat_interval=0.2)
    led: list[tuple[str, int]] = []
    elected = [anyio.Event() for _ in range(3)]

    async def work(lease: Lease, identity: str) -> None:
        led.append((identity, lease.token))
        elected[len(led) - 1].set()
        await anyio.sleep_forever()

    async with open_() as one, open_() as two, open_() as outside:
        first = Elector(one, "resign", ttl=4.0, identity="first")
        second = Elector(two, "resign", ttl=4.0, identity="second")
        async with anyio.create_task_group() as tg:
            tg.start_soon(first.run, work, "first")
            await elected[0].wait()
            tg.start_soon(second.run, work, "second")
            with anyio.fail_after(20):
                await elected[1].wait()  # the first again, after the rebalance
            holder = await _wait_for_holder(two, lambda h: h.token == led[1][1])
            assert holder.identity == "first"
            # A backend outside the group reads it from the broker (the leader record).
            seen = await outside.read("resign")
            assert seen is not None and (seen.identity, seen.token) == ("first", holder.token)
            assert await first.resign()
            with anyio.fail_after(4.0):  # the session timeout: a resign must not wait it out
                await elected[2].wait()
            tg.cancel_scope.cancel()
    assert [who for who, _ in led] == ["first", "first", "second"]
    assert led[0][1] < led[1][1] < led[2][1]


async def _wait_for_holder(
    backend: aiolease.abc.Backend,
    wanted: Callable[[aiolease.abc.HolderInfo], bool],
    name: str = "resign",
) -> aiolease.abc.HolderInfo:
    with anyio.fail_after(20):
        while True:
            holder = await backend.read(name)
            if holder is not None and wanted(holder):
                return holder
            await backend.wait_changed(name, holder)


async def test_an_unhealthy_leader_steps_down_and_leaves(
    anyio_backend: str, kafka_url: str
) -> None:
    """A failing health probe ends the term (``UNHEALTHY``): the member leaves the
    group, and the healthy candidate leads."""
    open_ = opener(kafka_url, heartbeat_interval=0.2)
    healthy = {"sick": True, "well": True}
    defeated: list[aiolease.LossReason] = []
    elected = {"sick": anyio.Event(), "well": anyio.Event()}

    async def work(lease: Lease, identity: str) -> None:
        elected[identity].set()
        await anyio.sleep_forever()

    async with open_() as one, open_() as two:
        sick = Elector(
            one,
            "health",
            ttl=SESSION,
            identity="sick",
            health=lambda: healthy["sick"],
            health_interval=0.2,
            health_failures=1,
            on_defeated=defeated.append,
        )
        well = Elector(two, "health", ttl=SESSION, identity="well")
        async with anyio.create_task_group() as tg:
            tg.start_soon(sick.run, work, "sick")
            with anyio.fail_after(20):
                await elected["sick"].wait()
            elected["sick"] = anyio.Event()
            tg.start_soon(well.run, work, "well")
            with anyio.fail_after(20):  # the sick one again, after the rebalance
                await elected["sick"].wait()
            healthy["sick"] = False
            with anyio.fail_after(20):
                await elected["well"].wait()
            tg.cancel_scope.cancel()
    assert defeated == [aiolease.LossReason.STOLEN, aiolease.LossReason.UNHEALTHY]


# -- stepping down in a rebalance ----------------------------------------------------------


async def test_a_rebalance_ends_the_term_before_the_next_one_starts(
    anyio_backend: str, kafka_url: str
) -> None:
    """A second candidate joining makes the group rebalance, which revokes the leader's
    assignment: its work is cancelled (``LeaseLostError``, ``STOLEN``) and over before
    the next generation's term starts, with a greater token; never two at once.

    The Kafka form of ``holder_reported`` and ``metadata_round_trip`` too: the
    candidate that waited longest leads the next term, and the other reads it, with
    its identity and unicode metadata exactly as given and the new term's token.
    """
    open_ = opener(kafka_url, heartbeat_interval=0.2)
    identity = "hôte-ü/1 ☃"
    running: list[str] = []
    terms: list[tuple[str, int]] = []
    events: list[str] = []
    overlaps: list[list[str]] = []
    started = [anyio.Event(), anyio.Event()]

    async def work(lease: Lease, who: str) -> None:
        if running:
            overlaps.append([*running, who])
        running.append(who)
        terms.append((who, lease.token))
        events.append(f"start {who}")
        started[min(len(terms), 2) - 1].set()
        try:
            await anyio.sleep_forever()
        finally:
            running.remove(who)
            events.append(f"stop {who}")

    async with open_() as one, open_() as two:
        first = Elector(
            one,
            "rebalance",
            ttl=SESSION,
            identity=identity,
            metadata=UNICODE_METADATA,
            on_defeated=lambda reason: events.append(f"defeated {reason.value}"),
        )
        second = Elector(two, "rebalance", ttl=SESSION, identity="second")
        async with anyio.create_task_group() as tg:
            tg.start_soon(first.run, work, "first")
            with anyio.fail_after(20):
                await started[0].wait()
            tg.start_soon(second.run, work, "second")
            with anyio.fail_after(20):
                await started[1].wait()
            holder = await _wait_for_holder(two, lambda h: h.token == terms[1][1], "rebalance")
            tg.cancel_scope.cancel()
    assert not overlaps, overlaps
    assert events[:4] == ["start first", "stop first", "defeated stolen", "start first"], events
    assert terms[1][1] > terms[0][1], terms
    assert (holder.identity, dict(holder.metadata)) == (identity, dict(UNICODE_METADATA))
