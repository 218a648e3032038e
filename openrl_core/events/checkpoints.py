"""Checkpoint events: what happens to a checkpoint record after a save made it.

The gateway records these synchronously (no worker acts on them): a checkpoint deleted by
its owner or expired by the reaper, published or unpublished, given a new expiry, or copied
under another training run. Each payload names the checkpoint by (run_id, checkpoint_id),
the projection's key. Expiry times travel as absolute instants, never as "now + ttl", so a
replay of the events table rebuilds the same rows whenever it runs.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, Optional

from openrl_core.events.base import Payload, event_type, register
from openrl_core.events.lifecycle import BlobRef, CheckpointSaved
from openrl_core.params import LoraConfig

FAMILY = "checkpoint"


class CheckpointRemoved(Payload):
    """The record is gone; `files` says which blobs it referenced (the reaper frees the
    ones no live checkpoint or sampling session still references)."""

    run_id: str
    checkpoint_id: str
    files: dict[str, BlobRef]
    expires_at: Optional[datetime] = None


class CheckpointVisibility(Payload):
    run_id: str
    checkpoint_id: str


class CheckpointTtlSet(Payload):
    run_id: str
    checkpoint_id: str
    ttl_seconds: Optional[int] = None
    expires_at: Optional[datetime] = None  # None: never expires


class CheckpointCopied(Payload):
    """A new checkpoint record sharing the source's blobs, under a training run made for it.

    `request_id` is the copy's identity for deduplication (the SDK retries copies under one
    idempotency key). The destination run cannot be trained: it exists to own the copy, so
    it carries the source run's base model, LoRA config and metadata and nothing else.
    `new_session_project_id` is set when the copy went to a project: the gateway then made a
    new session for it in that project (sessions are the only thing here that has one).
    """

    request_id: str
    source_path: str
    checkpoint: CheckpointSaved
    session_id: str
    base_model: str
    lora_config: Optional[LoraConfig] = None  # None for a full fine-tuning run
    full_finetune: bool = False
    user_metadata: Optional[dict[str, Any]] = None
    destination: Literal["session", "project"]
    new_session_project_id: Optional[str] = None


CHECKPOINT_DELETED = register(event_type(FAMILY, "delete", "completed"), CheckpointRemoved)
CHECKPOINT_EXPIRED = register(event_type(FAMILY, "expire", "completed"), CheckpointRemoved)
CHECKPOINT_PUBLISHED = register(event_type(FAMILY, "publish", "completed"), CheckpointVisibility)
CHECKPOINT_UNPUBLISHED = register(event_type(FAMILY, "unpublish", "completed"), CheckpointVisibility)
CHECKPOINT_TTL_SET = register(event_type(FAMILY, "set_ttl", "completed"), CheckpointTtlSet)
CHECKPOINT_COPIED = register(event_type(FAMILY, "copy", "completed"), CheckpointCopied)
