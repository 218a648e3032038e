"""Training runs, sessions and weights_info: read-only views of the projections.

A run is listed whatever its state (a run whose creation failed shows `corrupted: true`);
its `last_checkpoint` / `last_sampler_checkpoint` are its newest live `weights/` and
`sampler_weights/` checkpoints, so an expired or deleted one never shows. A session's
`training_run_ids` are every run created in it (failed ones and copies too) and its
`sampler_ids` every sampling session bound to it, in creation order; lists are newest
first. Another tenant's run or session is "unknown", exactly like one that never existed.
"""

from __future__ import annotations

from datetime import datetime
from typing import Optional

from fastapi import APIRouter, Depends

from eventing.store.projections import utc
from functions.gateway.context import GatewayContext
from functions.gateway.deps import get_ctx, get_tenant, require_session
from functions.gateway.routes.checkpoints import require_live_checkpoint, utcnow
from functions.gateway.routes.rest_wire import (
    GetSessionResponse,
    ListSessionsResponse,
    TrainingRun,
    TrainingRunsResponse,
    WeightsInfoRequest,
    WeightsInfoResponse,
    check_page,
    check_scope,
    checkpoint_of,
    cursor,
    string_metadata,
)
from openrl_core.errors import NotFound
from openrl_core.ids import TinkerPath
from openrl_core.params import LoraConfig

router = APIRouter(prefix="/api/v1")


def require_training_run(ctx: GatewayContext, tenant: str, run_id: str):
    row = ctx.projections.run(tenant, run_id)
    if row is None:
        raise NotFound(f"unknown training run {run_id!r}")
    return row


def training_run_of(ctx: GatewayContext, tenant: str, row, now: datetime) -> TrainingRun:
    def newest(kind: str):
        rows, _ = ctx.projections.live_checkpoints(tenant, now, run_id=row.model_id, kind=kind, limit=1)
        return checkpoint_of(rows[0]) if rows else None

    return TrainingRun(
        training_run_id=row.model_id,
        base_model=row.base_model,
        model_owner=tenant,
        is_lora=bool(row.is_lora),
        corrupted=row.state == "failed",
        lora_rank=row.lora_rank,
        last_request_time=utc(row.last_request_time),
        last_checkpoint=newest("weights"),
        last_sampler_checkpoint=newest("sampler_weights"),
        user_metadata=string_metadata(row.user_metadata),
    )


@router.get("/training_runs")
def list_training_runs(
    limit: int = 20,
    offset: int = 0,
    access_scope: str = "owned",
    project_id: Optional[str] = None,
    ctx: GatewayContext = Depends(get_ctx),
    tenant: str = Depends(get_tenant),
) -> TrainingRunsResponse:
    check_page(limit, offset)
    check_scope(access_scope)
    rows, total = ctx.projections.runs_page(tenant, limit, offset, project_id=project_id)
    now = utcnow()
    return TrainingRunsResponse(
        training_runs=[training_run_of(ctx, tenant, row, now) for row in rows], cursor=cursor(offset, limit, total)
    )


@router.get("/training_runs/{run_id}")
def get_training_run(
    run_id: str, access_scope: str = "owned", ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> TrainingRun:
    check_scope(access_scope)
    return training_run_of(ctx, tenant, require_training_run(ctx, tenant, run_id), utcnow())


@router.post("/weights_info")
def weights_info(
    body: WeightsInfoRequest, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> WeightsInfoResponse:
    """What a client needs to load a checkpoint: the run's base model and LoRA shape."""
    path = TinkerPath.parse(body.tinker_path)
    require_live_checkpoint(ctx, tenant, path, utcnow())
    run = require_training_run(ctx, tenant, path.run_id)
    lora = LoraConfig.model_validate(run.lora_config) if run.lora_config else None
    return WeightsInfoResponse(
        base_model=run.base_model,
        is_lora=bool(run.is_lora),
        lora_rank=run.lora_rank,
        train_unembed=lora.train_unembed if lora else None,
        train_mlp=lora.train_mlp if lora else None,
        train_attn=lora.train_attn if lora else None,
    )


@router.get("/sessions")
def list_sessions(
    limit: int = 20,
    offset: int = 0,
    access_scope: str = "owned",
    ctx: GatewayContext = Depends(get_ctx),
    tenant: str = Depends(get_tenant),
) -> ListSessionsResponse:
    check_page(limit, offset)
    check_scope(access_scope)
    rows, _ = ctx.projections.sessions_page(tenant, limit, offset)
    return ListSessionsResponse(sessions=[row.session_id for row in rows])


@router.get("/sessions/{session_id}")
def get_session(
    session_id: str,
    access_scope: str = "owned",
    ctx: GatewayContext = Depends(get_ctx),
    tenant: str = Depends(get_tenant),
) -> GetSessionResponse:
    check_scope(access_scope)
    session = require_session(ctx, tenant, session_id)
    runs = sorted(
        ctx.projections.runs_of_session(tenant, session_id), key=lambda row: (utc(row.created_at), row.model_id)
    )
    samplers = ctx.projections.sampling_sessions_of(tenant, session_id)
    return GetSessionResponse(
        training_run_ids=[row.model_id for row in runs],
        sampler_ids=[row.sampling_session_id for row in samplers],
        user_metadata=string_metadata(session.user_metadata),
        display_name=session.display_name,
    )
