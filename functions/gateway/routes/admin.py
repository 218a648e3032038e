"""The AdminClient's routes (SDK 0.38), served from the tenant's own event store.

- `GET /api/v1/audit?event_type&day`: the tenant's audit entries of one UTC day, oldest
  first, built from its stored events (`openrl_core/audit_log.py` says which events give
  which entry). At most `audit_log.MAX_ENTRIES` entries: the store reads that many + 1 of
  the filter's event types (SQL `LIMIT`), so a busy day is never read whole; a cut answer is
  the day's first entries and is logged.
- `GET /api/v1/billing/usage/events?starting_on&ending_before`: hourly usage of the window
  (`openrl_core/billing.py`): training, prefill and sampled tokens, checkpoint saves,
  storage gigabyte-hours, attributed to base model, session and the session's current
  project; `sessions` holds each of those sessions' user_metadata.
- `GET /api/v1/billing/usage/checkpoints/current[?project_id]`: the tenant's live
  checkpoints (not deleted, not past their expiry) grouped by their session's current
  project, `size_gigabytes` in decimal gigabytes (bytes / 1e9).

Nothing is priced self-hosted: every cost, rate and `cost_data_through` is null. The caller
is the one owner of what it sees: there are no organisations, so the user fields name the
tenant and every read is scoped to it; another tenant's usage never shows. Bad parameters
are a 400 naming the parameter, and nothing is recorded: these routes only read.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Optional

from fastapi import APIRouter, Depends

from eventing.store import usage_reads
from functions.gateway.context import GatewayContext
from functions.gateway.deps import get_ctx, get_tenant
from openrl_core import audit_log, billing
from openrl_core.errors import InvalidRequest
from openrl_core.wire.admin import (
    AuditLogResponse,
    BillingUsageResponse,
    CurrentCheckpointStorageUsageItem,
    CurrentCheckpointStorageUsageResponse,
)

router = APIRouter(prefix="/api/v1")
log = logging.getLogger(__name__)
MAX_PROJECT_ID = 200  # the sessions table's column: a longer one names no project


@router.get("/audit")
def get_audit_log(
    event_type: Optional[str] = None,
    day: Optional[str] = None,
    ctx: GatewayContext = Depends(get_ctx),
    tenant: str = Depends(get_tenant),
) -> AuditLogResponse:
    wanted = audit_log.parse_event_type(event_type)
    start, end = audit_log.day_window(audit_log.parse_day(day, datetime.now(timezone.utc)))
    events, cut = usage_reads.audit_events(
        ctx.store, tenant, audit_log.source_types(wanted), start, end, audit_log.MAX_ENTRIES
    )
    if cut:
        log.warning("audit log of tenant %s for %s (%s) cut at %d entries", tenant, start.date(), wanted, len(events))
    entries = [entry for event in events if (entry := audit_log.entry(event, wanted)) is not None]
    return AuditLogResponse.model_validate({"entries": entries})


@router.get("/billing/usage/events")
def get_billing_usage(
    starting_on: str,
    ending_before: str,
    ctx: GatewayContext = Depends(get_ctx),
    tenant: str = Depends(get_tenant),
) -> BillingUsageResponse:
    now = datetime.now(timezone.utc)
    start, end = billing.check_window(starting_on, ending_before, now)
    tokens, stored, metadata = usage_reads.usage(ctx.store.engine, tenant, start, end)
    data = billing.buckets(start, end, now, tokens, stored)
    for event in data:
        event.update(user_id=tenant, user_name=tenant)
    sessions = {sid: metadata[sid] for sid in {e["session_id"] for e in data if e["session_id"]} if sid in metadata}
    return BillingUsageResponse.model_validate(
        {"data": data, "sessions": {sid: {"user_metadata": meta} for sid, meta in sessions.items()}}
    )


@router.get("/billing/usage/checkpoints/current")
def get_current_checkpoint_storage_usage(
    project_id: Optional[str] = None,
    ctx: GatewayContext = Depends(get_ctx),
    tenant: str = Depends(get_tenant),
) -> CurrentCheckpointStorageUsageResponse:
    if project_id is not None and (not project_id.strip() or len(project_id) > MAX_PROJECT_ID):
        raise InvalidRequest(f"project_id must be a non-blank project id of at most {MAX_PROJECT_ID} characters")
    groups = usage_reads.current_storage(ctx.store.engine, tenant, datetime.now(timezone.utc), project_id)
    data = [
        CurrentCheckpointStorageUsageItem(
            project_id=project,
            org_user_urn=tenant,
            user_name=tenant,
            checkpoint_count=count,
            size_bytes=size,
            size_gigabytes=size / billing.GIGABYTE,
        )
        for project, count, size in groups
    ]
    return CurrentCheckpointStorageUsageResponse(data=data)
