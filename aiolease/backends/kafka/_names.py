"""Lease names as Kafka group ids and topic names.

A lease name becomes the consumer group ``<group_prefix><name>`` and the topic
``<topic_prefix><name>``. Topic names are the narrower: ASCII letters, digits, ``.``,
``_`` and ``-``, at most 249 characters, and neither ``.`` nor ``..``. A name that
cannot be both is refused with :class:`InvalidArgument` before anything is sent (no
silent encoding: the group and topic keep the name an operator can read).
"""

from __future__ import annotations

import re

from ..._exceptions import InvalidArgument

__all__ = ["MAX_TOPIC", "check_name", "check_prefix"]

#: Kafka's longest topic name.
MAX_TOPIC = 249
_LEGAL = re.compile(r"[A-Za-z0-9._-]*")


def check_prefix(what: str, prefix: str) -> str:
    """:raises InvalidArgument: ``prefix`` has characters a topic name cannot have"""
    if _LEGAL.fullmatch(prefix) is None or len(prefix) > MAX_TOPIC - 1:
        raise InvalidArgument(
            f"Kafka option {what}={prefix!r} may only hold ASCII letters, digits, '.', '_'"
            f" and '-' (at most {MAX_TOPIC - 1} of them)"
        )
    return prefix


def check_name(name: str, topic_prefix: str, group_prefix: str) -> tuple[str, str]:
    """The ``(group id, topic)`` of lease ``name``.

    :raises InvalidArgument: ``name`` cannot be part of a Kafka topic name
    """
    topic = topic_prefix + name
    if _LEGAL.fullmatch(name) is None:
        raise InvalidArgument(
            f"Kafka lease name {name!r} may only hold ASCII letters, digits, '.', '_' and '-'"
        )
    if len(topic) > MAX_TOPIC or topic in (".", ".."):
        raise InvalidArgument(
            f"Kafka lease name {name!r} makes the topic {topic!r}, which Kafka refuses"
            f" (at most {MAX_TOPIC} characters, not '.' or '..')"
        )
    return group_prefix + name, topic
