"""Wire models of the session REST methods SDK 0.38 added: search, project moves, traces.

Names and shapes as `tinker.types.SessionSearchRequest` / `SessionSearchResponse` /
`SessionSummary` have them, and the trace-export poll answer the SDK's RestClient reads
(`{status, url, error}`). Field constraints are the SDK's own (limit 1..200, at least one
status or owner urn when given), so a request the SDK would refuse to build is a 422 here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AwareDatetime, Field

from openrl_core.wire.base import WireRequest, WireResponse


class OwnSearchOwner(WireRequest):
    type: Literal["own"] = "own"


class AccessibleSearchOwner(WireRequest):
    type: Literal["accessible"] = "accessible"


class UserSearchOwner(WireRequest):
    type: Literal["user"] = "user"
    owner_urns: list[str] = Field(min_length=1, max_length=10)


SearchOwner = Annotated[Union[OwnSearchOwner, AccessibleSearchOwner, UserSearchOwner], Field(discriminator="type")]

FinishReasonType = Literal["success", "errored", "interrupted"]


class ActiveStatusQuery(WireRequest):
    type: Literal["active"] = "active"


class CancelledStatusQuery(WireRequest):
    type: Literal["cancelled"] = "cancelled"


class FailedStatusQuery(WireRequest):
    type: Literal["failed"] = "failed"


class ClientFinishedStatusQuery(WireRequest):
    type: Literal["client_finished"] = "client_finished"
    reasons: Optional[list[FinishReasonType]] = Field(default=None, min_length=1)


StatusQuery = Annotated[
    Union[ActiveStatusQuery, CancelledStatusQuery, FailedStatusQuery, ClientFinishedStatusQuery],
    Field(discriminator="type"),
]


class SessionSearchCursor(WireRequest):
    last_created_at: AwareDatetime = Field(strict=True)  # an RFC 3339 string, not a number
    last_session_id: str


class SessionSearchRequest(WireRequest):
    session_id: Optional[str] = None
    project_ids: Optional[list[str]] = None
    user_metadata: dict[str, str] = {}
    display_name: Optional[str] = Field(default=None, min_length=1)
    owner: SearchOwner = Field(default_factory=OwnSearchOwner)
    statuses: Optional[list[StatusQuery]] = Field(default=None, min_length=1)
    limit: int = Field(default=50, ge=1, le=200)
    cursor: Optional[SessionSearchCursor] = None


class SessionSearchSummary(WireResponse):
    session_id: str
    created_at: datetime
    owner: str
    project_id: str
    status: Optional[dict[str, Any]] = None
    checkpoints_count: int
    display_name: Optional[str] = None
    user_metadata: Optional[dict[str, str]] = None
    checkpoint_storage_bytes: Optional[int] = None


class SessionSearchResponse(WireResponse):
    sessions: list[SessionSearchSummary]
    next_cursor: Optional[dict[str, Any]] = None


class AssignSessionProjectRequest(WireRequest):
    project_id: Optional[str] = None


class TraceExportResponse(WireResponse):
    status: Literal["pending", "ready", "failed"]
    url: Optional[str] = None
    error: Optional[str] = None
