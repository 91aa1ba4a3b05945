"""A Kafka backend made around an ``aiokafka.AIOKafkaClient`` the application made:
an election runs through it, under asyncio and trio (through the bridge); each member's
own client is made with the user's client's settings; closing the backend leaves the
user's client open.
"""

from __future__ import annotations

import inspect
import ssl
import uuid
from contextlib import AsyncExitStack

import pytest
from aiokafka import AIOKafkaClient

from aiolease import Elector, InvalidArgument
from aiolease._bridge import adapt
from aiolease.backends.kafka import KafkaBackend
from aiolease.backends.kafka._backend import CLIENT_TIMEOUT_MS, _client
from tests.backends.kafka.support import SESSION, opener, unique_prefix
from tests.support import on_asyncio

pytestmark = pytest.mark.anyio

#: What a member's own client does not copy from the user's: aiokafka's own bound on
#: a request (a JoinGroup waits for the rebalance; the backend bounds each request
#: itself), and arguments that are no settings (the deprecated no-op ``api_version``).
NOT_COPIED = {"self", "loop", "api_version", "request_timeout_ms"}


async def test_an_election_runs_through_a_users_client(anyio_backend: str, kafka_url: str) -> None:
    """The backend leads through the user's client (not bootstrapped yet); the broker
    names the member after the user's ``client_id`` (Kafka makes member ids from it),
    so the member's own connection carries it too; after the backend closes, the
    user's client is still open (its metadata task runs, a request goes through)."""
    client_id = f"user-app-{uuid.uuid4().hex[:8]}"
    prefix = unique_prefix()
    async with AsyncExitStack() as stack:
        if anyio_backend == "trio":
            import trio_asyncio

            await stack.enter_async_context(trio_asyncio.open_loop())

        async def made() -> tuple[AIOKafkaClient, KafkaBackend]:
            client = AIOKafkaClient(
                bootstrap_servers=kafka_url.removeprefix("kafka://"),
                client_id=client_id,
                request_timeout_ms=7_000,
                retry_backoff_ms=50,
            )
            options = {"group_prefix": prefix, "topic_prefix": prefix}
            return client, KafkaBackend(client, session_timeout=SESSION, **options)

        client, backend = await on_asyncio(made)
        stack.push_async_callback(on_asyncio, client.close)
        async with adapt(backend) as bridged:  # the bridge under trio
            elector = Elector(bridged, "users-client", ttl=SESSION, identity="mine")
            async with elector.leadership() as lease:
                mine = await bridged.read("users-client")
                assert mine is not None and mine.token == lease.token
                async with opener(kafka_url, prefix=prefix)() as outside:
                    seen = await outside.read("users-client")
            assert seen is not None and seen.token == lease.token
            assert seen.owner.startswith(f"{client_id}-"), seen
        sync_task = client._sync_task
        assert sync_task is not None and not sync_task.done()  # not closed
        metadata = await on_asyncio(client.fetch_all_metadata)
        assert metadata.brokers()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_members_clients_copy_every_setting_of_the_users_client(anyio_backend: str) -> None:
    """Every constructor setting of ``AIOKafkaClient`` carries over to the members' own
    clients (a setting aiokafka adds later fails this test until it is copied or
    listed in :data:`NOT_COPIED`), but aiokafka's request timeout, which the backend
    sets above any JoinGroup's wait (it bounds each request itself)."""
    given = {
        "bootstrap_servers": ["h1:9092", "h2:9093"],
        "client_id": "app",
        "metadata_max_age_ms": 1234,
        "request_timeout_ms": 7000,
        "retry_backoff_ms": 250,
        "ssl_context": ssl.create_default_context(),
        "security_protocol": "SASL_SSL",
        "connections_max_idle_ms": 4321,
        "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_plain_username": "user",
        "sasl_plain_password": "s3cret",
        "sasl_kerberos_service_name": "kerberos",
        "sasl_kerberos_domain_name": "example.org",
        "sasl_oauth_token_provider": object(),
    }
    settings = set(inspect.signature(AIOKafkaClient.__init__).parameters) - NOT_COPIED
    assert settings == set(given) - {"request_timeout_ms"}
    user = AIOKafkaClient(**given)
    backend = KafkaBackend(user, group_prefix="app.")
    member = _client(backend._client_options)
    for setting in settings:
        attribute = "_retry_backoff" if setting == "retry_backoff_ms" else f"_{setting}"
        assert getattr(member, attribute) == getattr(user, attribute), setting
    assert member._request_timeout_ms == CLIENT_TIMEOUT_MS
    await backend.aclose()  # it made no member: nothing to close but its own state
    await user.close()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_only_an_aiokafka_client_is_accepted(anyio_backend: str) -> None:
    """Anything else is refused at once: without a client's settings, the members'
    clients would bootstrap from aiokafka's default (``localhost``)."""
    for wrong in (None, "kafka://127.0.0.1:9092", object()):
        with pytest.raises(InvalidArgument, match="AIOKafkaClient"):
            KafkaBackend(wrong)
