"""Topic names: one topic per tenant and stream, so tenants never share a partition.

Workers subscribe by pattern and so pick up a new tenant's topic without a restart.
"""

from __future__ import annotations

import re

PREFIX = "openrl"
STREAMS = ("training", "sampling", "completions", "control")


def topic(tenant: str, stream: str) -> str:
    if stream not in STREAMS:
        raise ValueError(f"unknown stream {stream!r}")
    return f"{PREFIX}.{tenant}.{stream}"


def pattern(stream: str) -> str:
    """A regular expression matching `stream` for every tenant."""
    return rf"^{re.escape(PREFIX)}\.[a-z0-9-]+\.{re.escape(stream)}$"


def tenant_of(topic_name: str) -> str:
    parts = topic_name.split(".")
    if len(parts) != 3 or parts[0] != PREFIX:
        raise ValueError(f"{topic_name!r} is not an OpenRL topic")
    return parts[1]
