"""Payloads shared by every asynchronous request: started, completed, failed.

A worker answers each `…requested` event with exactly one `…completed` or `…failed` event
of the same family and verb, carrying the request id. Completion payloads hold the wire
result (JSON-ready; tensors as `Array`) plus the typed facts projections need: a saved
checkpoint, a sampling session bound to new weights.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, Optional

from pydantic import Field

from openrl_core.events.base import Payload, event_type, register
from openrl_core.ids import CheckpointKind


class BlobRef(Payload):
    """A content-addressed blob in the tenant's blob store (the claim check)."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


class CheckpointSaved(Payload):
    run_id: str
    kind: CheckpointKind
    name: str
    files: dict[str, BlobRef]
    expires_at: Optional[datetime] = None
    user_metadata: Optional[dict[str, Any]] = None

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.run_id}/{self.kind}/{self.name}"

    @property
    def size_bytes(self) -> int:
        return sum(ref.size for ref in self.files.values())


class SamplingSessionBound(Payload):
    """Ephemeral `save_weights_and_get_sampling_client`: a session pinned to fresh weights."""

    sampling_session_id: str
    session_id: str
    base_model: str
    model_path: Optional[str] = None
    adapter: Optional[dict[str, BlobRef]] = None
    # A full fine-tuning run's weights: the manifest of their publication chain.
    weights: Optional[BlobRef] = None


class RequestStarted(Payload):
    request_id: str


class RequestCompleted(Payload):
    request_id: str
    result: dict[str, Any]
    checkpoint: Optional[CheckpointSaved] = None
    sampling_session: Optional[SamplingSessionBound] = None
    # What the worker reports beside the wire result (kept in the event, not in the future),
    # e.g. how a full run's sampler weights were published.
    details: Optional[dict[str, Any]] = None


class RequestFailed(Payload):
    request_id: str
    error: str
    category: Literal["user", "server", "unknown"] = "server"


def register_lifecycle(family: str, verb: str, requested: type[Payload]) -> dict[str, str]:
    """Register the four phases of one asynchronous verb; returns their type strings."""
    types = {
        "requested": register(event_type(family, verb, "requested"), requested),
        "started": register(event_type(family, verb, "started"), RequestStarted),
        "completed": register(event_type(family, verb, "completed"), RequestCompleted),
        "failed": register(event_type(family, verb, "failed"), RequestFailed),
    }
    return types
