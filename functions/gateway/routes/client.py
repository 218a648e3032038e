"""Client configuration, health, capabilities and telemetry."""

from __future__ import annotations

from collections import Counter

from fastapi import APIRouter, Depends

from eventing.store.run_views import RunViews
from functions.gateway.context import SOURCE, GatewayContext
from functions.gateway.deps import get_ctx, get_tenant
from functions.gateway.step_reports import step_reports
from openrl_core.events import new_event
from openrl_core.events.sessions import CLIENT_STEP_METRICS, TELEMETRY_RECEIVED, TelemetryReceived
from openrl_core.wire.sessions import ClientConfigRequest, TelemetrySendRequest

router = APIRouter(prefix="/api/v1")

# The SDK's own defaults, stated so a reader sees what the server promises: parallel
# forward_backward chunks of at most 1024 datums, which the trainer reorders by seq_id.
# Not a default: samples wait on one retrieve_futures long-poll per sampling session
# instead of one held retrieve_future each (tests/e2e/test_sdk_sampling_futures.py).
CLIENT_CONFIG = {
    "parallel_fwdbwd_chunks": True,
    "fwdbwd_max_chunk_len": 1024,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": True,
    "custom_loss_server_side": False,
    "pjwt_auth_enabled": False,
}


@router.post("/client/config")
def client_config(body: ClientConfigRequest, tenant: str = Depends(get_tenant)) -> dict:
    return CLIENT_CONFIG


@router.post("/client/dynamic_config")
def dynamic_config(body: ClientConfigRequest, tenant: str = Depends(get_tenant)) -> dict:
    # Abandoned samples are cancelled (cancel_future) instead of run for nobody.
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": True}


@router.get("/healthz")
def healthz() -> dict:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
def capabilities(ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)) -> dict:
    models = []
    for name in ctx.models.catalog.names():
        files = ctx.models.files(name)
        models.append(
            {"model_name": name, "max_context_length": files.max_context, "trainable": True, "sampleable": True}
        )
    return {"supported_models": models}


def owns_run(ctx: GatewayContext, tenant: str, run_id: str) -> bool:
    return RunViews(ctx.store.engine).run(tenant, run_id) is not None


@router.post("/telemetry")
def telemetry(
    body: TelemetrySendRequest, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> dict:
    kinds = Counter(event.event for event in body.events)
    payload = TelemetryReceived(
        session_id=body.session_id or "unknown",
        event_count=len(body.events),
        kinds=dict(kinds),
        sdk_version=body.sdk_version,
    )
    ctx.emit(new_event(TELEMETRY_RECEIVED, payload, tenant=tenant, source=SOURCE, key=body.session_id))
    # Step metrics the client reported (functions/gateway/step_reports.py), on their run's key.
    for report in step_reports(body.events, body.session_id, lambda run: owns_run(ctx, tenant, run)):
        ctx.emit(new_event(CLIENT_STEP_METRICS, report, tenant=tenant, source=SOURCE, key=report.model_id))
    return {"status": "accepted"}
