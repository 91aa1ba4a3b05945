"""The etcd backend over TLS with client certificates and a password, against a
private etcd that this module starts (and stops) on free ports."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import aiolease
from aiolease import AsyncLock
from aiolease.testing.pytest_plugin import server_missing
from tests.backends.etcd.support import WAIT, raises, unique_prefix

pytestmark = pytest.mark.anyio


@dataclass(frozen=True)
class SecureEtcd:
    """A private etcd that wants TLS with client certificates, and a password."""

    endpoint: str
    files: dict[str, str]
    run: Callable[..., None]

    def url(self, user: str = "root:secret", **files: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in {**self.files, **files}.items() if v)
        return f"etcd://{user}@{self.endpoint}?{query}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _certificates(where: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, by openssl."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=test-ca")
    (where / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for role, extra in (("server", ["-extfile", "ext.cnf"]), ("client", [])):
        openssl("req", *ec, "-keyout", f"{role}.key", "-out", f"{role}.csr", "-subj", "/CN=root")
        sign = ["-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2"]
        openssl("x509", "-req", "-in", f"{role}.csr", *sign, "-out", f"{role}.pem", *extra)
    return {
        "ca_file": str(where / "ca.pem"),
        "cert_file": str(where / "client.pem"),
        "key_file": str(where / "client.key"),
    }


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    missing = [tool for tool in ("etcd", "etcdctl", "openssl") if shutil.which(tool) is None]
    if missing:
        problem = f"{', '.join(missing)} not installed (bash scripts/services.sh install etcd)"
        server_missing(problem)
    where = tmp_path_factory.mktemp("secure-etcd")
    files = _certificates(where)
    client, peer = _free_port(), _free_port()
    endpoint = f"127.0.0.1:{client}"
    tls = ["--cert-file", str(where / "server.pem"), "--key-file", str(where / "server.key")]
    command = [
        *("etcd", "--name", "secure", "--data-dir", str(where / "data")),
        *("--listen-client-urls", f"https://{endpoint}", "--advertise-client-urls"),
        *(f"https://{endpoint}", "--listen-peer-urls", f"http://127.0.0.1:{peer}"),
        *("--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}"),
        *("--initial-cluster", f"secure=http://127.0.0.1:{peer}"),
        *(*tls, "--client-cert-auth", "--trusted-ca-file", files["ca_file"]),
    ]
    log = (where / "etcd.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def run(*args: str) -> None:
        certs = ["--cacert", files["ca_file"], "--cert", files["cert_file"]]
        ctl = ["etcdctl", f"--endpoints=https://{endpoint}", *certs, "--key", files["key_file"]]
        subprocess.run(
            [*ctl, *args], check=True, capture_output=True, env={**os.environ, "ETCDCTL_API": "3"}
        )

    try:
        deadline = time.monotonic() + WAIT
        while True:  # etcd has no readiness signal but answering
            try:
                run("endpoint", "health")
                break
            except subprocess.CalledProcessError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.1)
        run("user", "add", "root", "--new-user-password=secret", "--interactive=false")
        run("auth", "enable")
        yield SecureEtcd(endpoint, files, run)
    finally:
        process.kill()
        process.wait()
        log.close()


async def test_tls_and_password(anyio_backend: str, secure_etcd: SecureEtcd) -> None:
    async with aiolease.open_backend(secure_etcd.url(), prefix=unique_prefix()) as backend:
        lease = await AsyncLock(backend, "n", ttl=5).acquire()
        assert await backend.read("n") is not None
        # The server forgets every token when auth is switched off and on: log in again.
        secure_etcd.run("--user", "root:secret", "auth", "disable")
        secure_etcd.run("auth", "enable")
        assert await lease.release()
        assert await backend.read("n") is None


@pytest.mark.parametrize(
    ("user", "files"),
    [
        ("root:wrong", {}),
        ("root:secret", {"ca_file": ""}),  # the server's certificate is not trusted
        ("root:secret", {"cert_file": "", "key_file": ""}),  # no client certificate
    ],
    ids=["password", "server-cert", "client-cert"],
)
async def test_tls_and_password_are_checked(
    anyio_backend: str, secure_etcd: SecureEtcd, user: str, files: dict[str, str]
) -> None:
    with raises(aiolease.BackendUnavailable, match="etcd"):
        async with aiolease.open_backend(secure_etcd.url(user, **files) + "&timeout=3"):
            pass  # pragma: no cover
