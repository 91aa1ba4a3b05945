"""Backend URLs with a password: no message, repr or exception chain ever shows it.

Every scheme gets malformed URLs that carry a password; the error must be an
:class:`InvalidArgument` in whose text (``str``, ``repr``, ``args``, and every
exception it was raised from or while handling) the password never appears, as
written or percent-decoded. Valid URLs with a password are opened on the real
servers: the backend's repr, or the error of a server that refuses the password,
does not show it either.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

import aiolease
from aiolease import BackendError, InvalidArgument
from aiolease._registry import backend_class, scheme_of
from aiolease._urls import MASK, redact, scrub
from aiolease.backends.etcd._url import parse_url as parse_etcd_url
from aiolease.backends.kafka._url import parse_url as parse_kafka_url
from aiolease.backends.mongo._url import parse_url as parse_mongo_url
from aiolease.backends.redlock._url import parse_url as parse_redlock_url

pytestmark = pytest.mark.anyio

SECRET = "s3cret"
#: The password percent-encoded: neither form may show.
ENCODED = "s3%63ret"

#: A malformed URL with a password for every scheme, in each way it can be malformed.
MALFORMED = [
    # The cases of the issue.
    f"redis://:{SECRET}@127.0.0.1:99999/0",
    f"redis://:{SECRET}@127.0.0.1:6379/abc",
    f"redis+cluster://:{SECRET}@127.0.0.1:7000,garbage",
    f"redis+redlock://:{SECRET}@127.0.0.1:6381,127.0.0.1:6381",
    f"postgresql://postgres:{SECRET}@127.0.0.1:notaport/test",
    f"postgresql://postgres:{SECRET}@127.0.0.1:5432/test#fragment",
    f"mysql://root:{SECRET}@127.0.0.1:3306/",
    f"etcd://root:{SECRET}@127.0.0.1:2379/path",
    # Redis, one server.
    f"rediss://:{SECRET}@127.0.0.1:99999/0",
    f"redis://user:{SECRET}@127.0.0.1:6379/0?bogus=1",
    f"redis://:{SECRET}@127.0.0.1:6379/0#fragment",
    f"redis://:{SECRET}@127.0.0.1:6379/0?socket_timeout=soon",
    f"redis://:{ENCODED}@127.0.0.1:port/0",
    f"unix://:{SECRET}@/",
    # Cluster and Sentinel.
    f"rediss+cluster://:{SECRET}@127.0.0.1:7000/3",
    f"redis+cluster://:{SECRET}@127.0.0.1:7000?socket_timeout=soon",
    f"redis+sentinel://:{SECRET}@127.0.0.1:26379,nohost/aiolease",
    f"rediss+sentinel://:{SECRET}@127.0.0.1:26379",
    f"redis+sentinel://127.0.0.1:26379/aiolease?sentinel_password={SECRET}&bogus=1",
    # Redlock.
    f"rediss+redlock://:{SECRET}@127.0.0.1:6381/abc",
    f"redis+redlock://u:{SECRET}@",
    f"redis+redlock://:{SECRET}@127.0.0.1:6381#fragment",
    # PostgreSQL.
    f"postgres://postgres:{SECRET}@127.0.0.1:99999999/test",
    f"postgresql://postgres:{ENCODED}@127.0.0.1:5432/test?table=1bad",
    f"postgresql://postgres:{SECRET}@127.0.0.1:5432/test?sslmode=bogus",
    # MySQL / MariaDB.
    f"mariadb://root:{SECRET}@127.0.0.1:3306/",
    f"mysql://root:{SECRET}@127.0.0.1:port/test",
    f"mysql://root:{SECRET}@127.0.0.1:3306/test?bogus=1",
    f"mysql://root:{SECRET}@127.0.0.1:3306/test#fragment",
    # etcd.
    f"etcd://root:{SECRET}@127.0.0.1:port",
    f"etcd://root:{SECRET}@127.0.0.1:2379?prefix=a&&=",
    f"etcd://root:{ENCODED}@127.0.0.1:2379#fragment",
    # MongoDB.
    f"mongodb://root:{SECRET}@127.0.0.1:port/aiolease",
    f"mongodb://root:{SECRET}@127.0.0.1:27017/aiolease?collection=system.x",
    f"mongodb://root:{SECRET}@127.0.0.1:27017/bad$db",
    f"mongodb://root:{SECRET}@127.0.0.1:27017/aiolease?bogusOption=1",
    f"mongodb://root:{ENCODED}@127.0.0.1:27017/aiolease#fragment",
    f"mongodb+srv://root:{SECRET}@127.0.0.1:27017/aiolease",
    f"mongodb+srv://root:{SECRET}@host.example/aiolease?fair=maybe",
    # Kafka.
    f"kafka://u:{SECRET}@127.0.0.1:port",
    f"kafka://u:{SECRET}@127.0.0.1:9092/path",
    f"kafka://u:{ENCODED}@127.0.0.1:9092?bogus=1",
    f"kafka://u:{SECRET}@127.0.0.1:9092?session_timeout=soon",
    f"kafka://u:{SECRET}@[::1",
    f"kafka://u:s3c/{SECRET}@127.0.0.1:9092",
    # ZooKeeper (no login: any user is refused).
    f"zookeeper://root:{SECRET}@127.0.0.1:2181",
    f"zookeeper://root:{SECRET}@127.0.0.1:port/chroot",
    f"zk://root:{ENCODED}@127.0.0.1:2181?session_timeout=soon",
    f"zookeeper://root:{SECRET}@127.0.0.1:2181/a/../b",
    f"zookeeper://root:{SECRET}@[::1",
    f"zookeeper://root:s3c/{SECRET}@127.0.0.1:2181",
    # The embedded ones take no password at all.
    f"sqlite://user:{SECRET}@host/leases.db",
    f"memory://user:{SECRET}@host",
    # An unclosed IPv6 bracket (raw ValueError from urlsplit before).
    f"redis://:{SECRET}@[::1",
    f"postgresql://postgres:{SECRET}@[::1/test",
    f"mysql://root:{SECRET}@[::1/test",
    f"etcd://root:{SECRET}@[::1",
    f"mongodb://root:{SECRET}@[::1/aiolease",
    # A password holding '/' unescaped: a parser cuts the netloc there, and would
    # quote the first half as a host or port.
    f"redis://:s3c/{SECRET}@127.0.0.1:6379/0",
    f"redis+cluster://:s3c/{SECRET}@127.0.0.1:7000",
    f"redis+redlock://:s3c/{SECRET}@127.0.0.1:6381",
    f"postgresql://postgres:s3c/{SECRET}@127.0.0.1:5432/test",
    f"mysql://root:s3c/{SECRET}@127.0.0.1:3306/test",
    f"etcd://root:s3c/{SECRET}@127.0.0.1:2379",
    f"mongodb://root:s3c/{SECRET}@127.0.0.1:27017/aiolease",
]


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception it was raised from or while handling."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]
        todo += list(getattr(current, "exceptions", ()))


def assert_hidden(exc: BaseException, *secrets: str) -> None:
    """No text of ``exc`` or of its chain shows any of ``secrets``."""
    for link in _chain(exc):
        texts = [str(link), repr(link), *map(str, link.args)]
        for secret in secrets:
            assert not any(secret in text for text in texts), (secret, link)


def _scheme_id(url: str) -> str:
    return url.partition("://")[0]


@pytest.mark.parametrize("url", MALFORMED, ids=[_scheme_id(u) for u in MALFORMED])
async def test_malformed_urls_never_show_the_password(anyio_backend: str, url: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        async with aiolease.open_backend(url):
            pass  # pragma: no cover
    assert_hidden(caught.value, SECRET, ENCODED)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # some drivers need asyncio
@pytest.mark.parametrize("url", MALFORMED, ids=[_scheme_id(u) for u in MALFORMED])
async def test_backends_parse_malformed_urls_without_showing_the_password(
    anyio_backend: str, url: str
) -> None:
    """The backend's own ``from_url``, as a user may call it (no ``open_backend``)."""
    scheme = url.partition("://")[0]
    with pytest.raises(InvalidArgument) as caught:
        backend = await backend_class(scheme).from_url(url)
        await backend.aclose()  # pragma: no cover
    assert_hidden(caught.value, SECRET, ENCODED)


async def test_unknown_options_are_named(anyio_backend: str) -> None:
    with pytest.raises(InvalidArgument, match="'foo'"):
        async with aiolease.open_backend("memory://", foo=1):
            pass  # pragma: no cover


def test_scheme_of_a_malformed_url_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="Invalid IPv6") as caught:
        scheme_of(f"redis://:{SECRET}@[::1")
    assert_hidden(caught.value, SECRET)


#: The URLs of the issue, as the CLI was given them.
CLI_URLS = MALFORMED[:8]


@pytest.mark.parametrize("how", ["option", "env"])
@pytest.mark.parametrize("url", CLI_URLS, ids=[_scheme_id(u) for u in CLI_URLS])
def test_the_cli_never_prints_the_password(url: str, how: str) -> None:
    args = ["status", "n"] + (["--backend", url] if how == "option" else [])
    result = subprocess.run(
        [sys.executable, "-m", "aiolease", *args],
        text=True,
        capture_output=True,
        env={**os.environ, "AIOLEASE_URL": url},
        timeout=60,
    )
    assert result.returncode != 0
    assert "error" in result.stderr and "Traceback" not in result.stderr
    assert SECRET not in result.stdout + result.stderr
    assert MASK in result.stderr


# -- valid URLs with a password, on the real servers ----------------------------------

#: Servers that take any password (trust auth, no requirepass): the backend opens.
OPENS = {
    "redis-cluster": lambda url: url.replace("://", f"://:{SECRET}@", 1),
    "redis-sentinel": lambda url: url.replace("://", f"://:{SECRET}@", 1),
    "redis-redlock": lambda url: url.replace("://", f"://:{SECRET}@", 1),
    "postgres": lambda url: url.replace("postgres@", f"postgres:{SECRET}@", 1),
}
#: Servers that refuse a password they do not expect: the error does not show it.
REFUSES = {
    "redis": lambda url: url.replace("://", f"://user:{SECRET}@", 1),
    "mariadb": lambda url: url.replace("root@", f"root:{SECRET}@", 1),
    "etcd": lambda url: url.replace("://", f"://root:{SECRET}@", 1),
    "mongo": lambda url: url.replace("://", f"://root:{SECRET}@", 1),
}


@pytest.mark.parametrize("service", sorted(OPENS))
async def test_the_repr_of_a_backend_opened_with_a_password_hides_it(
    anyio_backend: str, aiolease_server: Callable[[str], str], service: str
) -> None:
    url = OPENS[service](aiolease_server(service))
    assert SECRET in url
    async with aiolease.open_backend(url) as backend:
        assert SECRET not in repr(backend) and SECRET not in str(backend)


@pytest.mark.parametrize("service", sorted(REFUSES))
async def test_a_refused_password_is_not_in_the_error(
    anyio_backend: str, aiolease_server: Callable[[str], str], service: str
) -> None:
    url = REFUSES[service](aiolease_server(service))
    assert SECRET in url
    with pytest.raises(BackendError) as caught:
        async with aiolease.open_backend(url):
            pass  # pragma: no cover
    assert_hidden(caught.value, SECRET)


async def test_a_missing_capability_does_not_show_the_password(
    anyio_backend: str, aiolease_server: Callable[[str], str]
) -> None:
    url = OPENS["postgres"](aiolease_server("postgres"))
    with pytest.raises(aiolease.UnsupportedCapability) as caught:
        async with aiolease.open_backend(url, require=[aiolease.Capability.SESSION]):
            pass  # pragma: no cover
    assert_hidden(caught.value, SECRET)
    assert f"postgres:{MASK}@" in str(caught.value)


def test_parsed_urls_do_not_show_the_password() -> None:
    redlock = parse_redlock_url(f"redis+redlock://u:{SECRET}@h:1,h:2")
    assert redlock.credentials == {"username": "u", "password": SECRET}
    etcd = parse_etcd_url(f"etcd://root:{SECRET}@h:2379", {})
    assert etcd.user == ("root", SECRET)
    mongo = parse_mongo_url(f"mongodb+srv://root:{SECRET}@h/db?collection=c", {})
    assert SECRET in mongo.client_url and mongo.database == "db"
    kafka = parse_kafka_url(f"kafka://u:{SECRET}@h:9092", {})
    assert kafka.user == ("u", SECRET)
    assert SECRET not in repr(redlock) + repr(etcd) + repr(mongo) + repr(kafka) + kafka.described()


# -- the helper ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://user@host/0", "redis://user@host/0"),
        ("redis://:pw@host/0", f"redis://:{MASK}@host/0"),
        ("etcd://root:pw@a:1,b:2?prefix=x", f"etcd://root:{MASK}@a:1,b:2?prefix=x"),
        ("postgresql://u:p%40w@[::1/db", f"postgresql://u:{MASK}@[::1/db"),
        ("redis://:p@w/x?y@host/0", f"redis://:{MASK}@host/0"),
        ("redis://h/0?password=pw&x=1", f"redis://h/0?password={MASK}&x=1"),
        ("redis://h/0?Sentinel_Password=pw", f"redis://h/0?Sentinel_Password={MASK}"),
        ("no url at all", "no url at all"),
        ("", ""),
    ],
)
def test_redact(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_redact_shows_no_other_type() -> None:
    assert redact(b"redis://:pw@h") == "<bytes>"


def test_scrub_masks_the_url_and_every_piece_of_its_password() -> None:
    url = "redis://:ab/cd%21@host/0"
    assert scrub(f"bad {url}: port 'ab'; cd! and ab/cd%21", url) == (
        f"bad redis://:{MASK}@host/0: port '{MASK}'; {MASK} and {MASK}"
    )
    assert scrub("nothing to hide", "memory://") == "nothing to hide"
