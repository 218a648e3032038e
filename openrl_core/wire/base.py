"""Base classes of the wire layer and the asynchronous-result envelopes."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict


def _finite_json(value: dict[str, Any]) -> dict[str, Any]:
    """NaN and the infinities are not JSON (RFC 8259), though Python's and pydantic's parsers
    take the bare tokens: refused here, because PostgreSQL's JSON columns refuse them too, so
    the same request would be stored on one deployment and fail on the other."""
    pending: list[Any] = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError("holds NaN or infinity, which JSON cannot carry")
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return value


# A free-form JSON object of the client's (user_metadata, optimizer configs): any JSON value
# but NaN and the infinities.
JsonObject = Annotated[dict[str, Any], AfterValidator(_finite_json)]


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
