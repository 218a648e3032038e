"""The OpenRL API's runs: list, show, per-step metrics (JSONL) and cancel, under `/api/openrl/v1`.

This is OpenRL's own API, apart from Tinker's `/api/v1`: what `openrl runs` (and agents)
read. Every answer is JSON with a `schema` field naming its version (`openrl.runs.v1`, ...);
keys are stable and numbers are numbers, times ISO 8601 in UTC. A tenant's key sees its own
runs; the operator's key (`settings.operator_api_key`) sees every tenant's. Another tenant's
run answers exactly like a run that does not exist (404).

Metrics are one JSON object per completed optim_step, one per line
(`application/x-ndjson`): `step`, `loss` (sum of the step's forward_backward `loss:sum`),
`optim/grad_norm`, `learning_rate`, `tokens` (of the step's training forward_backward data),
`forward_backward` (calls), `step_seconds` (from the gateway taking the step's first request
to its optim_step completing), `queue_wait_seconds` (from that first request to the trainer
beginning it), `completed_at`, `sampled_tokens` / `sampling_seconds` / `sampling_tokens_per_s`
(the run's samples that finished since the previous step, eventing/store/step_extras.py) and
`reported`: what the client reported for the step through the SDK's telemetry (e.g.
`{"reward": 0.7}`; functions/gateway/step_reports.py). A step only the client reported has
a row with the server's numbers null. A number the server does not know is null.

Cancel records `training.run.cancelled` (once: a second cancel is a 409 that changes
nothing). Its projection fails the run's unfinished futures and those of the sampling
sessions on its weights (category `user`, message starting "cancelled") and closes those
sessions; the event then reaches the run's trainer, which drops the run's state. Later Tinker
requests for the run answer 410. Checkpoints the run saved stay.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Iterator, Optional

from fastapi import APIRouter, Body, Depends
from fastapi.responses import StreamingResponse

from eventing import topics
from eventing.store import step_extras
from eventing.store.event_store import Dedup
from eventing.store.projections import utc
from eventing.store.run_views import RunViews
from functions.gateway.context import SOURCE, GatewayContext
from functions.gateway.deps import Caller, get_caller, get_ctx
from functions.gateway.routes.checkpoints import utcnow
from functions.gateway.submit import training_stream
from openrl_core.errors import Conflict, InvalidRequest, NotFound
from openrl_core.events import new_event
from openrl_core.events.training import RUN_CANCELLED, RunCancelled
from openrl_core.wire.futures import MAX_POSITION

PREFIX = "/api/openrl/v1"
router = APIRouter(prefix=PREFIX)
STATUSES = ("active", "finished", "creating", "cancelled", "failed", "frozen")
MAX_LIMIT = 1000
MAX_OFFSET = 2**31 - 1  # larger ones overflow the databases' 64-bit integers


def views(ctx: GatewayContext) -> RunViews:
    return RunViews(ctx.store.engine)


def iso(moment: Optional[datetime]) -> Optional[str]:
    return utc(moment).isoformat() if moment is not None else None


def seconds(start: Optional[datetime], end: Optional[datetime]) -> Optional[float]:
    if start is None or end is None:
        return None
    return round((utc(end) - utc(start)).total_seconds(), 6)


def require_visible_run(ctx: GatewayContext, caller: Caller, run_id: str):
    row = views(ctx).run(caller.tenant, run_id)
    if row is None:
        raise NotFound(f"unknown training run {run_id!r}")
    return row


def run_json(row) -> dict[str, Any]:
    return {
        "run_id": row.model_id,
        "tenant": row.tenant,
        "status": RunViews.status(row),
        "base_model": row.base_model,
        "training": "lora" if row.is_lora else "full",
        "lora_rank": row.lora_rank,
        "steps": int(row.steps),
        "session_id": row.session_id,
        "created_at": iso(row.created_at),
        "last_activity": iso(row.last_request_time),
        "cancelled_at": iso(row.cancelled_at),
        "forked_from": {"run": row.forked_from_run, "step": int(row.forked_from_step)} if row.forked_from_run else None,
        "last_checkpoint": row.last_checkpoint,
        "last_sampler_checkpoint": row.last_sampler_checkpoint,
    }


def step_json(row) -> dict[str, Any]:
    return {
        "schema": "openrl.metrics.v1",
        "step": int(row.step),
        "loss": row.loss,
        "optim/grad_norm": row.grad_norm,
        "learning_rate": row.learning_rate,
        "tokens": int(row.tokens),
        "forward_backward": int(row.forward_backward),
        "step_seconds": seconds(row.first_request_at, row.completed_at),
        "queue_wait_seconds": seconds(row.first_request_at, row.started_at),
        "completed_at": iso(row.completed_at),
    }


NO_SAMPLES = {"sampled_tokens": None, "sampling_seconds": None, "sampling_tokens_per_s": None}
EMPTY_STEP = {"schema": "openrl.metrics.v1", "step": None, "loss": None, "optim/grad_norm": None, "learning_rate": None,
              "tokens": None, "forward_backward": None, "step_seconds": None, "queue_wait_seconds": None,
              "completed_at": None, **NO_SAMPLES}  # fmt: skip


def check_limits(limit: int, offset: int) -> None:
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidRequest(f"limit must be between 1 and {MAX_LIMIT}, got {limit}")
    if not 0 <= offset <= MAX_OFFSET:
        raise InvalidRequest(f"offset must be between 0 and {MAX_OFFSET}, got {offset}")


@router.get("/runs")
def list_runs(
    limit: int = 100,
    offset: int = 0,
    status: Optional[str] = None,
    ctx: GatewayContext = Depends(get_ctx),
    caller: Caller = Depends(get_caller),
) -> dict:
    check_limits(limit, offset)
    if status is not None and status not in STATUSES:
        raise InvalidRequest(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
    rows, total = views(ctx).runs(caller.tenant, limit, offset, status)
    return {"schema": "openrl.runs.v1", "runs": [run_json(row) for row in rows], "total": total, "offset": offset}


@router.get("/runs/{run_id}")
def show_run(run_id: str, ctx: GatewayContext = Depends(get_ctx), caller: Caller = Depends(get_caller)) -> dict:
    row = require_visible_run(ctx, caller, run_id)
    store = views(ctx)
    steps = store.steps(run_id)
    checkpoints = store.checkpoints(row.tenant, utcnow(), run_id=run_id)
    samplers = store.sampling_sessions_of_run(row.tenant, run_id)
    return {
        "schema": "openrl.run.v1",
        "run": run_json(row),
        "last_step": step_json(steps[-1]) if steps else None,
        "pending_requests": len(store.open_futures(row.tenant, [run_id])),
        "checkpoints": [checkpoint_json(c) for c in checkpoints],
        "sampling_sessions": [
            {
                "sampling_session_id": s.sampling_session_id,
                "created_at": iso(s.created_at),
                "closed_at": iso(s.closed_at),
            }
            for s in samplers
        ],
    }


def checkpoint_json(row) -> dict[str, Any]:
    return {
        "tinker_path": row.tinker_path,
        "run_id": row.run_id,
        "tenant": row.tenant,
        "kind": row.kind,
        "checkpoint_id": row.checkpoint_id,
        "size_bytes": int(row.size_bytes),
        "created_at": iso(row.created_at),
        "expires_at": iso(row.expires_at),
        "public": bool(row.public),
    }


@router.get("/runs/{run_id}/metrics")
def run_metrics(
    run_id: str, after_step: int = 0, ctx: GatewayContext = Depends(get_ctx), caller: Caller = Depends(get_caller)
) -> StreamingResponse:
    run = require_visible_run(ctx, caller, run_id)
    if not 0 <= after_step <= MAX_POSITION:  # a bound the store's 64-bit integers set
        raise InvalidRequest(f"after_step must be between 0 and {MAX_POSITION}, got {after_step}")
    steps = views(ctx).steps(run_id)
    sampled = step_extras.sampling(ctx.store.engine, run.tenant, run_id, steps)
    reported = step_extras.reported(ctx.store, run.tenant, run_id)
    rows = {int(row.step): {**step_json(row), **sampled.get(int(row.step), NO_SAMPLES)} for row in steps}
    for step in reported.keys() - rows.keys():
        rows[step] = {**EMPTY_STEP, "step": step}
    chosen = [{**rows[step], "reported": reported.get(step, {})} for step in sorted(rows) if step > after_step]

    def lines() -> Iterator[str]:
        for row in chosen:
            yield json.dumps(row, separators=(",", ":")) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.post("/runs/{run_id}/cancel")
def cancel_run(
    run_id: str,
    body: Optional[dict] = Body(None),
    ctx: GatewayContext = Depends(get_ctx),
    caller: Caller = Depends(get_caller),
) -> dict:
    reason = (body or {}).get("reason")
    if reason is not None and (not isinstance(reason, str) or len(reason) > 500):  # 0 or false is no reason either
        raise InvalidRequest("reason must be a string of at most 500 characters")
    reason = reason or "cancelled"
    row = require_visible_run(ctx, caller, run_id)
    if row.state == "cancelled":
        raise Conflict(f"training run {run_id!r} is already cancelled (at {iso(row.cancelled_at)})")
    if row.state in ("failed", "frozen"):
        what = "failed to load" if row.state == "failed" else "is a copy made by copy_weights, which never trains"
        raise Conflict(f"training run {run_id!r} {what}: there is nothing to cancel")
    payload = RunCancelled(model_id=run_id, reason=reason, by="operator" if caller.operator else "owner")
    event = new_event(RUN_CANCELLED, payload, tenant=row.tenant, source=SOURCE, key=run_id, subject=run_id)
    # On the run's own training topic and key: the trainer sees it after every request of the
    # run sent before it. One cancel per run: a concurrent second one is a duplicate.
    where = topics.topic(row.tenant, training_stream(not row.is_lora), ctx.models.canonical(row.base_model))
    store = views(ctx)
    samplers = [
        s.sampling_session_id for s in store.sampling_sessions_of_run(row.tenant, run_id) if s.closed_at is None
    ]
    unfinished = store.open_futures(row.tenant, [run_id, *samplers])
    appended = ctx.emit(event, where, Dedup.of(f"cancel-run:{run_id}", b""))
    if not appended.stored:
        raise Conflict(f"training run {run_id!r} is already cancelled")
    # Wake the long-polls held on them (on every replica): they now answer the failure.
    ctx.announce(store.cancelled_futures(row.tenant, [run_id, *samplers]))
    return {
        "schema": "openrl.cancel.v1",
        "run_id": run_id,
        "status": "cancelled",
        "cancelled_requests": len(unfinished),
        "closed_sampling_sessions": samplers,
    }
