"""Opening the gRPC channel to etcd: plain, or TLS with the files a URL names; and the
durations of the backend's options."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
from aetcd import rpc

from ..._exceptions import InvalidArgument
from ..._validate import check_seconds
from ._url import parse_bool
from ._wire import CHANNEL_OPTIONS, grpc_target, is_ip

__all__ = ["open_channel", "seconds"]


async def open_channel(endpoints: tuple[tuple[str, int], ...], tls: dict[str, Any]) -> Any:
    """A channel to ``endpoints``; ``tls`` holds the TLS options (taken out of it).

    :raises InvalidArgument: TLS files given with ``tls=0``, or a file that cannot be read
    """

    target = await grpc_target(endpoints)
    options = list(CHANNEL_OPTIONS.items())
    files = {k: tls.pop(k) for k in ("ca_file", "cert_file", "key_file") if k in tls}
    secure = parse_bool("tls", tls.pop("tls", bool(files)))
    if not secure:
        if files:
            raise InvalidArgument("etcd TLS files were given with tls=0")
        return rpc.insecure_channel(target, options=options)
    loaded: dict[str, bytes | None] = {}
    for key, path in files.items():
        try:
            loaded[key] = await asyncio.to_thread(Path(str(path)).read_bytes)
        except OSError as exc:
            raise InvalidArgument(f"etcd option {key}={path!r}: {exc}") from None
    credentials = grpc.ssl_channel_credentials(
        root_certificates=loaded.get("ca_file"),
        private_key=loaded.get("key_file"),
        certificate_chain=loaded.get("cert_file"),
    )
    host = endpoints[0][0]
    if len(endpoints) > 1 and not (is_ip(host, 4) or is_ip(host, 6)):
        # The addresses were resolved here: check the certificate against the name.
        options.append(("grpc.ssl_target_name_override", host))
    return rpc.secure_channel(target, credentials, options=options)


def seconds(what: str, value: object) -> float:
    """:raises InvalidArgument: ``value`` (a number, or a string from a URL) is no duration"""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise InvalidArgument(f"etcd option {what}={value!r} is not a number") from None
    return check_seconds(what, value, allow_zero=what == "session_idle")
