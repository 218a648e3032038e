"""Client configuration, sessions, heartbeats, telemetry."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from openrl_core.wire.base import JsonObject, WireRequest, WireResponse


class ClientConfigRequest(WireRequest):
    sdk_version: Optional[str] = None


class CreateSessionRequest(WireRequest):
    tags: list[str] = Field(default_factory=list)
    user_metadata: JsonObject = Field(default_factory=dict)
    sdk_version: Optional[str] = None
    project_id: Optional[str] = None
    display_name: Optional[str] = None


class CreateSessionResponse(WireResponse):
    type: Literal["create_session"] = "create_session"
    session_id: str
    info_message: Optional[str] = None


class SessionHeartbeatRequest(WireRequest):
    session_id: str


class FinishReason(WireRequest):
    type: str = "success"


class FinishSessionRequest(WireRequest):
    reason: FinishReason = Field(default_factory=FinishReason)
    detail: Optional[str] = None


class TelemetryEvent(WireRequest):
    event: str = "GENERIC_EVENT"
    # A generic event's name and data (tinker.types.GenericEvent); other kinds carry neither.
    event_name: Optional[str] = None
    event_data: dict[str, Any] = Field(default_factory=dict)


class TelemetrySendRequest(WireRequest):
    events: list[TelemetryEvent] = Field(default_factory=list)
    session_id: Optional[str] = None
    sdk_version: Optional[str] = None
