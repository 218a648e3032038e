"""Base classes of the wire layer and the asynchronous-result envelopes."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict


class WireRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class WireResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UntypedAPIFuture(WireResponse):
    request_id: str
    model_id: Optional[str] = None
    sample_sequence_ids: Optional[list[str]] = None


class TryAgainResponse(WireResponse):
    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"] = "active"
    queue_state_reason: Optional[str] = None


class RequestFailedResponse(WireResponse):
    error: str
    category: Literal["unknown", "server", "user"]


class FutureRetrieveRequest(WireRequest):
    request_id: str
    allow_metadata_only: bool = False
