"""Sessions: create, heartbeat, finish."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from functions.gateway.context import SOURCE, GatewayContext
from functions.gateway.deps import get_ctx, get_tenant, require_session
from openrl_core.errors import Gone
from openrl_core.events import new_event
from openrl_core.events.sessions import (
    SESSION_CREATED,
    SESSION_FINISHED,
    SESSION_HEARTBEAT,
    SessionCreated,
    SessionFinished,
    SessionHeartbeat,
)
from openrl_core.ids import new_uuid
from openrl_core.wire.sessions import (
    CreateSessionRequest,
    CreateSessionResponse,
    FinishSessionRequest,
    SessionHeartbeatRequest,
)

router = APIRouter(prefix="/api/v1")


@router.post("/create_session")
def create_session(
    body: CreateSessionRequest, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> CreateSessionResponse:
    session_id = new_uuid()
    payload = SessionCreated(
        session_id=session_id,
        tags=body.tags,
        user_metadata=body.user_metadata,
        sdk_version=body.sdk_version,
        project_id=body.project_id,
        display_name=body.display_name,
    )
    ctx.emit(new_event(SESSION_CREATED, payload, tenant=tenant, source=SOURCE, key=session_id, subject=session_id))
    return CreateSessionResponse(session_id=session_id)


@router.post("/session_heartbeat")
def heartbeat(
    body: SessionHeartbeatRequest, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> dict:
    session = require_session(ctx, tenant, body.session_id)
    if session.finished_at is not None:
        raise Gone(f"session {body.session_id!r} has finished")
    payload = SessionHeartbeat(session_id=body.session_id)
    ctx.emit(new_event(SESSION_HEARTBEAT, payload, tenant=tenant, source=SOURCE, key=body.session_id))
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
def finish(
    session_id: str,
    body: FinishSessionRequest,
    ctx: GatewayContext = Depends(get_ctx),
    tenant: str = Depends(get_tenant),
) -> dict:
    session = require_session(ctx, tenant, session_id)
    if session.finished_at is None:
        payload = SessionFinished(session_id=session_id, reason=body.reason.type, detail=body.detail)
        ctx.emit(new_event(SESSION_FINISHED, payload, tenant=tenant, source=SOURCE, key=session_id, subject=session_id))
    return {"status": "finished"}
