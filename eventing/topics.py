"""Topic names: one topic per tenant and stream, so tenants never share a partition.

The work streams (`training`, `sampling`) are also split by base model: the trainer or
sampler of one base model reads only its own topics, and several replicas of it split
their partitions. `completions` and `control` are per tenant. Workers subscribe by
pattern, so a new tenant's topic is picked up without a restart.

    openrl.<tenant>.training.<model-slug>        LoRA runs (one trainer shares the base)
    openrl.<tenant>.training-full.<model-slug>   full fine-tuning runs (a trainer, or one per run)
    openrl.<tenant>.sampling.<model-slug>
    openrl.<tenant>.completions
    openrl.<tenant>.control
"""

from __future__ import annotations

import functools
import hashlib
import re
from typing import Iterable, Optional

PREFIX = "openrl"
WORK_STREAMS = ("training", "training-full", "sampling")
STREAMS = (*WORK_STREAMS, "completions", "control")


@functools.lru_cache(maxsize=4096)  # every submission names its topic
def model_slug(base_model: str) -> str:
    """A topic-safe name for a base model; the hash keeps distinct names distinct."""
    readable = re.sub(r"[^a-z0-9]+", "-", base_model.lower()).strip("-")[:60]
    return f"{readable}-{hashlib.sha256(base_model.encode()).hexdigest()[:6]}"


def topic(tenant: str, stream: str, base_model: Optional[str] = None) -> str:
    if stream not in STREAMS:
        raise ValueError(f"unknown stream {stream!r}")
    if stream in WORK_STREAMS:
        if base_model is None:
            raise ValueError(f"the {stream} stream is per base model")
        return f"{PREFIX}.{tenant}.{stream}.{model_slug(base_model)}"
    return f"{PREFIX}.{tenant}.{stream}"


def pattern(stream: str, base_models: Optional[Iterable[str]] = None) -> str:
    """A regular expression matching `stream` for every tenant (and the given base models)."""
    head = rf"^{re.escape(PREFIX)}\.[a-z0-9-]+\.{re.escape(stream)}"
    if stream not in WORK_STREAMS:
        return head + "$"
    if base_models is None:
        return head + r"\.[a-z0-9-]+$"
    return head + r"\.(" + "|".join(re.escape(model_slug(m)) for m in base_models) + ")$"


def everything() -> str:
    return rf"^{re.escape(PREFIX)}\.[a-z0-9-]+\.[a-z-]+(\.[a-z0-9-]+)?$"


def tenant_of(topic_name: str) -> str:
    parts = topic_name.split(".")
    if len(parts) not in (3, 4) or parts[0] != PREFIX:
        raise ValueError(f"{topic_name!r} is not an OpenRL topic")
    return parts[1]
