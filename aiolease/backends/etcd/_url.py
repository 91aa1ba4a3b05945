"""``etcd://`` URLs and connection options.

::

    etcd://[user[:password]@]host[:port][,host[:port]...][?option=value&...]

A host without a port gets 2379. Options (in the query, or as keyword arguments to
``from_url``, not both): ``prefix``, ``fair``, ``timeout``, ``session_idle``, and for
TLS ``tls`` (``1``/``0``), ``ca_file``, ``cert_file``, ``key_file`` (giving any of
the files turns TLS on).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._exceptions import InvalidArgument
from ..._urls import EndpointsUrl, parse_endpoints_url

__all__ = ["DEFAULT_PORT", "EtcdUrl", "parse_bool", "parse_url"]

#: etcd's client port.
DEFAULT_PORT = 2379
#: Options taken by :meth:`EtcdBackend.from_url <aiolease.backends.etcd.EtcdBackend.from_url>`.
OPTIONS = frozenset(
    {"prefix", "fair", "timeout", "session_idle", "tls", "ca_file", "cert_file", "key_file"}
)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


#: A parsed ``etcd://`` URL: its members, user and options.
EtcdUrl = EndpointsUrl


def parse_bool(what: str, value: object) -> bool:
    """:raises InvalidArgument: ``value`` is neither a bool nor a yes/no string"""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise InvalidArgument(f"etcd option {what}={value!r} is not a yes/no value")


def parse_url(url: str, options: Mapping[str, Any]) -> EtcdUrl:
    """Split ``url`` and merge the keyword ``options`` in.

    :raises InvalidArgument: a malformed URL, an unknown option, or one given twice
    """
    return parse_endpoints_url(
        url,
        options,
        scheme="etcd",
        what="an etcd",
        server="etcd endpoint",
        known=OPTIONS,
        default_port=DEFAULT_PORT,
        path_hint="give the key prefix as ?prefix=...",
    )
