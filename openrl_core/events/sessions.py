"""Session events: the client's lifetime, recorded synchronously by the gateway."""

from __future__ import annotations

from typing import Any, Optional

from openrl_core.events.base import Payload, event_type, register

FAMILY = "session"


class SessionCreated(Payload):
    session_id: str
    tags: list[str] = []
    user_metadata: dict[str, Any] = {}
    sdk_version: Optional[str] = None
    project_id: Optional[str] = None
    display_name: Optional[str] = None


class SessionHeartbeat(Payload):
    session_id: str


class SessionFinished(Payload):
    session_id: str
    reason: str
    detail: Optional[str] = None


class SessionProjectAssigned(Payload):
    """`assign_session_project`: the session (and so its runs and samplers) moves to a project."""

    session_id: str
    project_id: str


class TelemetryReceived(Payload):
    session_id: str
    event_count: int
    kinds: dict[str, int]
    sdk_version: Optional[str] = None


SESSION_CREATED = register(event_type(FAMILY, "create", "completed"), SessionCreated)
SESSION_HEARTBEAT = register(event_type(FAMILY, "heartbeat", "completed"), SessionHeartbeat)
SESSION_FINISHED = register(event_type(FAMILY, "finish", "completed"), SessionFinished)
SESSION_PROJECT_ASSIGNED = register(event_type(FAMILY, "assign_project", "completed"), SessionProjectAssigned)
TELEMETRY_RECEIVED = register(event_type(FAMILY, "telemetry", "completed"), TelemetryReceived)


class ClientStepMetrics(Payload):
    """Numbers a client reported for one step of one of its runs, through the SDK's telemetry
    (a generic event named `openrl.step_metrics`): what only the client knows, such as reward."""

    model_id: str
    step: int
    metrics: dict[str, float]
    session_id: Optional[str] = None


# Phase "reported", not "completed": it is no request's completion, so no future is folded from it.
CLIENT_STEP_METRICS = register(event_type(FAMILY, "step_metrics", "reported"), ClientStepMetrics)
