"""Forking a run at a step, `POST /api/openrl/v1/runs/{run_id}/fork` (`openrl runs fork`).

Body: `{"step": N}` (and optionally `"wait_seconds"`, 0-300, default 60). The answer names a
new training run of the same tenant, base model, LoRA config and kind (LoRA or full), whose
weights and optimizer state are the run's right after its N-th completed optim_step, and
the `tinker://<fork>/weights/forked-at-step-N` path of that state with its optimizer, which
`create_training_client_from_state_with_optimizer` loads. The fork is a run of its own too,
in a session of its own (`<session>:train:0`), trainable under its id from seq_id 1.

How: the gateway reads the run's history from the event store (`run_history`), plans the
rebuild (`openrl_core.forking`: the latest snapshot at or before N whose files are all still
stored, else the run's creation, plus the logged requests up to the N-th optim_step) and
records it all in one `training.fork.requested` event on the new run's training topic and
key. The trainer rebuilds the state from that event alone and saves it; the run turns
`ready`. The route then waits (woken by the completion, no polling) up to `wait_seconds`
and answers `status`: `ready`, `failed` (with `error`) or `creating` (not done yet: the
same request again, with the same `X-Idempotency-Key`, waits on the same fork).

Rules: an unknown run and another tenant's run are the same 404 (the operator may fork any
tenant's run; the fork belongs to that tenant). N must be 0 to the run's completed steps
(400 otherwise). A cancelled run may be forked: its history up to its cancellation is intact.
A run still being created, one that failed to load, and a copy made by copy_weights (which
never trained) have nothing to fork (409), as has a history whose files were deleted since
(a checkpoint the run loaded, say: 409 naming it). Step 0 is the run right after creation.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from typing import Any, Optional

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from eventing import topics
from eventing.store.event_store import Dedup
from eventing.store.run_history import RunHistory, run_history
from functions.gateway import quotas
from functions.gateway.context import SOURCE, GatewayContext
from functions.gateway.deps import Caller, get_caller, get_ctx, read_body
from functions.gateway.routes.checkpoints import blobs_of
from functions.gateway.routes.openrl_runs import PREFIX, require_visible_run, views
from functions.gateway.submit import training_stream
from openrl_core import forking
from openrl_core.errors import Conflict, InvalidRequest, ServerError
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.futures import FutureState, is_terminal
from openrl_core.ids import model_id_for, new_request_id, new_uuid
from openrl_core.params import LoraConfig

router = APIRouter(prefix=PREFIX)
FIELDS = {"step", "wait_seconds"}
DEFAULT_WAIT, MAX_WAIT = 60.0, 300.0
# A retried fork (same X-Idempotency-Key) names the same session, so it is the same fork.
FORK_NAMESPACE = uuid.UUID("0b7f6a0e-2c1d-4f8e-9a53-5d6c7e8f9a01")


def checkpoint_name(step: int) -> str:
    return f"forked-at-step-{step}"


def parse_body(raw: bytes) -> tuple[int, float]:
    try:
        body = json.loads(raw or b"null")
    except ValueError:
        raise InvalidRequest('the body must be JSON: {"step": N}') from None
    if not isinstance(body, dict) or "step" not in body:
        raise InvalidRequest('the body must be a JSON object with the step to fork at: {"step": N}')
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown field(s) {unknown}; a fork takes step and wait_seconds")
    step, wait = body["step"], body.get("wait_seconds", DEFAULT_WAIT)
    if isinstance(step, float) and step.is_integer():
        step = int(step)  # 3.0 is the integer 3 in JSON (and in the route's JSON Schema)
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidRequest(f"step must be an integer (a count of completed optim_steps), got {step!r}")
    if step < 0:
        raise InvalidRequest(f"step must be 0 or more, got {step}")
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= MAX_WAIT:
        raise InvalidRequest(f"wait_seconds must be a number from 0 to {MAX_WAIT:.0f}, got {wait!r}")
    return step, float(wait)


def check_forkable(row) -> None:
    if row.state == "creating":
        raise Conflict(f"training run {row.model_id!r} is still being created; fork it once it is ready")
    if row.state == "failed":
        raise Conflict(f"training run {row.model_id!r} failed to load: there is nothing to fork")
    if row.state == "frozen":
        raise Conflict(
            f"training run {row.model_id!r} is a copy made by copy_weights, which never trains: there is nothing to "
            "fork; load its checkpoint with create_training_client_from_state instead"
        )


def replayed(event) -> te.Replayed:
    return te.Replayed(type=event.type, data=event.data.model_dump(mode="json"))


def _check_files(ctx: GatewayContext, tenant: str, refs, what: str) -> None:
    blobs = blobs_of(ctx)
    if not all(blobs.exists(tenant, ref) for ref in refs.values()):
        raise Conflict(f"cannot rebuild this step: the files of {what} are no longer stored")


def prepare(ctx: GatewayContext, row, step: int, fork_session: str) -> te.ForkRequested:
    """The fork event for `row` at `step`: every check first, so a refusal stores nothing."""
    check_forkable(row)
    tenant, run_id = row.tenant, row.model_id
    history: RunHistory = run_history(ctx.store, tenant, run_id)
    if history.origin is None:
        raise ServerError(f"training run {run_id!r} has no creation event in the store")
    blobs = blobs_of(ctx)
    stored = {s.next_seq: s for s in history.snapshots if all(blobs.exists(tenant, ref) for ref in s.files.values())}
    plan = forking.plan(history.logged, sorted(stored), step)
    snapshot = stored.get(plan.snapshot_next_seq) if plan.snapshot_next_seq is not None else None
    origin = None
    if snapshot is None:
        origin = history.origin
        if origin.type == te.LOAD_WEIGHTS["requested"]:
            _check_files(ctx, tenant, origin.data.files, f"the checkpoint {origin.data.path} the run was created from")
    replay = [history.requests[seq_id] for seq_id in plan.replay]
    for event in replay:
        if event.type == te.LOAD_WEIGHTS["requested"]:
            _check_files(
                ctx,
                tenant,
                event.data.files,
                f"the checkpoint {event.data.path} the run loaded at seq_id {event.data.seq_id}",
            )
    session = ctx.projections.session(tenant, row.session_id)
    return te.ForkRequested(
        request_id=new_request_id(),
        model_id=model_id_for(fork_session, 0),
        session_id=fork_session,
        parent_id=run_id,
        step=step,
        parent_seq_id=plan.through_seq,
        base_model=row.base_model,
        lora_config=LoraConfig.model_validate(row.lora_config) if row.lora_config else LoraConfig(),
        full_finetune=not row.is_lora,
        user_metadata=row.user_metadata,
        project_id=session.project_id if session is not None else None,
        snapshot=snapshot,
        snapshot_step=plan.snapshot_step,
        origin=replayed(origin) if origin is not None else None,
        replay=[replayed(event) for event in replay],
        checkpoint_name=checkpoint_name(step),
    )


def submit(ctx: GatewayContext, row, step: int, raw: bytes, idempotency_key: Optional[str]) -> tuple[str, str]:
    """Record the fork; returns (fork run id, request id), the first ones for a retry."""
    dedup = None
    fork_session = new_uuid()
    if idempotency_key:
        digest = hashlib.sha256(f"{row.model_id}\n{idempotency_key}".encode()).hexdigest()
        fork_session = str(uuid.uuid5(FORK_NAMESPACE, f"{row.tenant}\n{digest}"))
        dedup = Dedup.of(f"fork:{digest}", raw)
        earlier = ctx.projections.run(row.tenant, model_id_for(fork_session, 0))
        if earlier is not None:  # a retry: answer the first fork, rebuild nothing again
            if (earlier.forked_from_run, earlier.forked_from_step) != (row.model_id, step):
                raise Conflict(f"this X-Idempotency-Key was used for a fork at step {earlier.forked_from_step}")
            return earlier.model_id, views(ctx).fork_request(row.tenant, earlier.model_id)
    payload = prepare(ctx, row, step, fork_session)
    event = new_event(
        te.FORK["requested"],
        payload,
        tenant=row.tenant,
        source=SOURCE,
        key=payload.model_id,
        subject=payload.request_id,
    )
    where = topics.topic(row.tenant, training_stream(payload.full_finetune), ctx.models.canonical(row.base_model))
    with quotas.admitted(ctx, row.tenant, quotas.cost_of(payload), dedup):  # a fork is a request in flight
        appended = ctx.emit(event, where, dedup)
    return payload.model_id, appended.duplicate_of or payload.request_id


@router.post("/runs/{run_id}/fork")
async def fork_run(
    run_id: str, request: Request, ctx: GatewayContext = Depends(get_ctx), caller: Caller = Depends(get_caller)
) -> dict:
    raw = await read_body(request, 4096)
    step, wait = parse_body(raw)
    row = await run_in_threadpool(require_visible_run, ctx, caller, run_id)
    fork_id, request_id = await run_in_threadpool(submit, ctx, row, step, raw, request.headers.get("x-idempotency-key"))
    future = await _wait(ctx, row.tenant, request_id, wait)
    return _answer(row, step, fork_id, request_id, future)


async def _wait(ctx: GatewayContext, tenant: str, request_id: str, seconds: float):
    deadline = time.monotonic() + seconds
    with ctx.waiters.watch(request_id) as woken:
        while True:
            woken.clear()  # before reading: a completion landing during the read still wakes us
            future = await run_in_threadpool(ctx.projections.future, tenant, request_id)
            remaining = deadline - time.monotonic()
            if future is None or is_terminal(FutureState(future.state)) or remaining <= 0:
                return future
            try:
                await asyncio.wait_for(woken.wait(), timeout=remaining)
            except asyncio.TimeoutError:
                pass


def _answer(row, step: int, fork_id: str, request_id: str, future) -> dict[str, Any]:
    state = FutureState(future.state) if future is not None else FutureState.PENDING
    status = {FutureState.COMPLETED: "ready", FutureState.FAILED: "failed", FutureState.CANCELLED: "cancelled"}.get(
        state, "creating"
    )
    result = (future.result or {}) if state is FutureState.COMPLETED else {}
    return {
        "schema": "openrl.fork.v1",
        "run_id": fork_id,
        "status": status,
        "forked_from": {"run": row.model_id, "step": step},
        "tinker_path": f"tinker://{fork_id}/weights/{checkpoint_name(step)}",
        "request_id": request_id,
        "rebuilt_from": {
            "snapshot_step": result.get("snapshot_step"),
            "replayed_requests": result.get("replayed_requests"),
        }
        if result
        else None,
        "error": future.error if future is not None and state in (FutureState.FAILED, FutureState.CANCELLED) else None,
    }
