"""The session REST methods SDK 0.38 added: search_sessions, assign_session_project and
export_session_trace.

- `POST /api/v1/sessions/search`: the caller's sessions matching the filters, newest first,
  keyset-paged (`eventing/store/session_search.py`). A tenant is the one owner of its
  sessions, so owner `own` and `accessible` both search the tenant's sessions and `user`
  matches only when its owner urns name the tenant (`SessionSummary.owner`). Statuses: a
  session is `active` until its client finishes it, then `client_finished` with the reason
  the client gave; nothing here cancels or fails a session, so `cancelled` and `failed`
  match none.
- `PUT /api/v1/sessions/{id}/project`: moves the session, and with it its runs' and
  samplers' project, as the SDK documents; a `session.assign_project` event, so it replays.
  A missing or empty project id is a 400; there are no project ACLs, so any well-formed
  project id is the tenant's.
- `GET /api/v1/sessions/{id}/trace_export`: builds the session's Chrome trace from the
  event store now (`openrl_core/session_trace.py`), stores it as a blob and answers `ready`
  with a signed download link (the same links as external weights: `downloads.py`), so the
  SDK's poll finishes on its first answer. The JSON trace format is what Perfetto's UI
  opens, though the SDK names the file `.pftrace`. The blob is referenced by no record, so
  the blob collector may delete it once `blob_grace_seconds` pass: the link expires by
  then, and asking again builds a fresh trace.

Another tenant's session is unknown here exactly as one that never existed (404).
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone

from fastapi import APIRouter, Depends, Request

from eventing.store.projections import utc
from eventing.store.session_search import DEFAULT_PROJECT, SessionFilter, SessionSearch
from eventing.store.session_trace import SessionTrace
from functions.gateway.context import SOURCE, GatewayContext
from functions.gateway.deps import get_ctx, get_tenant, read_body, require_session
from functions.gateway.downloads import base_url, link, server_secret
from functions.gateway.routes.checkpoints import blobs_of
from functions.gateway.routes.openrl_timeline import ask_timeline, owner_of
from functions.timeslicer.setup import socket_path
from openrl_core import session_trace
from openrl_core.errors import InvalidRequest
from openrl_core.events import new_event
from openrl_core.events.sessions import SESSION_PROJECT_ASSIGNED, SessionProjectAssigned
from openrl_core.wire.session_search import (
    AssignSessionProjectRequest,
    SessionSearchRequest,
    SessionSearchResponse,
    SessionSearchSummary,
    TraceExportResponse,
)

router = APIRouter(prefix="/api/v1")
MAX_PROJECT_ID = 200  # the sessions table's column
# Not blank, no control characters (openapi_bodies.project_rules says the same as schema).
PROJECT_ID = re.compile(r"[^\x00-\x1f\x7f]*\S[^\x00-\x1f\x7f]*")


def _states(body: SessionSearchRequest) -> set[str] | None:
    if body.statuses is None:
        return None
    states: set[str] = set()
    for status in body.statuses:
        if status.type == "active":
            states.add("active")
        elif status.type == "client_finished":
            states |= {f"finished:{r}" for r in status.reasons} if status.reasons else {"finished:*"}
    return states


def _status(row) -> dict:
    if row.finished_at is None:
        return {"type": "active"}
    reason = row.finish_reason if row.finish_reason in ("success", "errored", "interrupted") else None
    return {"type": "client_finished", "reason": {"type": reason or "success"}}


@router.post("/sessions/search")
async def search_sessions(
    request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> SessionSearchResponse:
    body = SessionSearchRequest.model_validate_json(await read_body(request, ctx.settings.max_request_bytes))
    if body.owner.type == "user" and tenant not in body.owner.owner_urns:
        return SessionSearchResponse(sessions=[])
    wanted = SessionFilter(
        session_id=body.session_id,
        display_name=body.display_name,
        project_ids=body.project_ids,
        user_metadata=dict(body.user_metadata),
        states=_states(body),
    )
    after = None
    if body.cursor is not None:
        after = (body.cursor.last_created_at.astimezone(timezone.utc), body.cursor.last_session_id)
    hits, more = SessionSearch(ctx.store.engine).page(tenant, wanted, body.limit, after)
    sessions = [
        SessionSearchSummary(
            session_id=hit.row.session_id,
            created_at=utc(hit.row.created_at),
            owner=tenant,
            project_id=hit.row.project_id or DEFAULT_PROJECT,
            status=_status(hit.row),
            checkpoints_count=hit.checkpoints_count,
            display_name=hit.row.display_name,
            user_metadata={str(k): str(v) for k, v in (hit.row.user_metadata or {}).items()},
            checkpoint_storage_bytes=hit.checkpoint_storage_bytes,
        )
        for hit in hits
    ]
    cursor = None
    if more and sessions:
        last = sessions[-1]
        cursor = {"last_created_at": last.created_at.isoformat(), "last_session_id": last.session_id}
    return SessionSearchResponse(sessions=sessions, next_cursor=cursor)


@router.put("/sessions/{session_id}/project")
async def assign_session_project(
    session_id: str, request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> None:
    body = AssignSessionProjectRequest.model_validate_json(await read_body(request, ctx.settings.max_request_bytes))
    require_session(ctx, tenant, session_id)
    project_id = body.project_id
    if not project_id or not project_id.strip():
        raise InvalidRequest(
            "assign_session_project needs a project_id (clearing a session's project is not supported)"
        )
    if len(project_id) > MAX_PROJECT_ID or not PROJECT_ID.fullmatch(project_id):
        raise InvalidRequest(
            f"project_id must be text of at most {MAX_PROJECT_ID} characters, without control characters"
        )
    payload = SessionProjectAssigned(session_id=session_id, project_id=project_id)
    ctx.emit(
        new_event(SESSION_PROJECT_ASSIGNED, payload, tenant=tenant, source=SOURCE, key=session_id, subject=session_id)
    )


def _timeslicer_entries(ctx: GatewayContext, run_ids: set[str]) -> dict[str, list[dict]]:
    """The node timeslicer's entries for these runs, when this gateway can reach one."""
    path = socket_path(ctx.settings)
    if not run_ids or not path.exists():
        return {}
    try:
        entries = ask_timeline(str(path), 0.0)
    except (OSError, ValueError, KeyError):
        return {}
    out: dict[str, list[dict]] = {}
    for device, items in entries.items():
        mine = []
        for entry in items:
            run_id, _, role = owner_of(str(entry.get("job", "")))
            if run_id in run_ids:
                kept = {k: entry[k] for k in ("kind", "start", "end", "reason", "bytes") if k in entry}
                mine.append({**kept, "run_id": run_id, "holder": role})
        if mine:
            out[str(device)] = mine
    return out


@router.get("/sessions/{session_id}/trace_export")
def export_session_trace(
    session_id: str, request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> TraceExportResponse:
    require_session(ctx, tenant, session_id)
    reads = SessionTrace(ctx.store)
    keys = reads.keys(tenant, session_id)
    labels = {session_id: f"session {session_id}"}
    labels |= {run: f"run {run}" for run in keys.runs} | {s: f"sampler {s}" for s in keys.samplers}
    now = datetime.now(timezone.utc)
    trace = session_trace.build(
        session_id, reads.envelopes(tenant, session_id, keys), labels, now, _timeslicer_entries(ctx, set(keys.runs))
    )
    ref = blobs_of(ctx).put(tenant, json.dumps(trace, sort_keys=True).encode())
    lifetime = min(ctx.settings.download_link_seconds, max(60.0, ctx.settings.blob_grace_seconds))
    expires = int((now + timedelta(seconds=lifetime)).timestamp())
    url = link(base_url(ctx, request), server_secret(ctx.settings), tenant, ref, f"{session_id}.json", expires)
    return TraceExportResponse(status="ready", url=url)
