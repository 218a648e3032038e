"""Projections: how each event changes the read tables, folded in the event's transaction.

Each handler is a small function of (rows, event) that reads and writes rows through the
transaction's unit of work (`eventing.store.unit_of_work.Rows`), never SQL of its own, so a
batch of events costs a few statements in all. Futures follow the pure state machine in
`openrl_core.futures`; a late or repeated lifecycle event leaves a finished future as it is.
Replaying the events table through `apply` rebuilds every table exactly.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Optional, Union, cast

from eventing.store.projection_rows import (
    HANDLERS,
    fold_future,
    handles,
    insert_run,
    put_checkpoint,
    record_removal,
    touch_run,
    upsert_checkpoint,
)
from eventing.store.unit_of_work import Rows, utc
from openrl_core.events import Event
from openrl_core.events import access as access_events
from openrl_core.events import checkpoints as checkpoint_events
from openrl_core.events import sampling as sampling_events
from openrl_core.events import sessions as session_events
from openrl_core.events import training as training_events
from openrl_core.events.lifecycle import RequestCompleted, RequestFailed, SamplingSessionBound
from openrl_core.events.recovery import SNAPSHOT_TAKEN
from openrl_core.futures import FutureState
from openrl_core.ids import TinkerPath

__all__ = ["apply", "expiry", "utc"]

# The requests that only touch their run (`_training_requested`).
_TrainingRequest = Union[
    training_events.ForwardBackwardRequested,
    training_events.OptimStepRequested,
    training_events.SaveWeightsRequested,
    training_events.SaveWeightsForSamplerRequested,
    training_events.SaveWeightsExternalRequested,
]


def apply(rows: Rows, event: Event) -> None:
    handler = HANDLERS.get(event.type)
    if handler is not None:
        handler(rows, event)
    elif event.phase in ("requested", "started", "completed", "failed"):
        fold_future(rows, event)


# -- sessions ------------------------------------------------------------------------------


@handles(session_events.SESSION_CREATED)
def _session_created(rows: Rows, event: Event) -> None:
    data = cast(session_events.SessionCreated, event.data)
    rows.insert(
        "sessions",
        session_id=data.session_id,
        tenant=event.tenant,
        tags=list(data.tags),
        user_metadata=dict(data.user_metadata),
        sdk_version=data.sdk_version,
        project_id=data.project_id,
        display_name=data.display_name,
        created_at=event.time,
        last_heartbeat_at=event.time,
    )


@handles(session_events.SESSION_HEARTBEAT)
def _session_heartbeat(rows: Rows, event: Event) -> None:
    data = cast(session_events.SessionHeartbeat, event.data)
    rows.update("sessions", (data.session_id,), last_heartbeat_at=event.time)


@handles(session_events.SESSION_FINISHED)
def _session_finished(rows: Rows, event: Event) -> None:
    data = cast(session_events.SessionFinished, event.data)
    rows.update("sessions", (data.session_id,), finished_at=event.time, finish_reason=data.reason)


@handles(session_events.SESSION_PROJECT_ASSIGNED)
def _session_project_assigned(rows: Rows, event: Event) -> None:
    data = cast(session_events.SessionProjectAssigned, event.data)
    rows.update("sessions", (data.session_id,), project_id=data.project_id)


@handles(session_events.TELEMETRY_RECEIVED, training_events.SEQ_SKIPPED, SNAPSHOT_TAKEN, access_events.LOOKUP_REFUSED)
def _no_projection(rows: Rows, event: Event) -> None:
    """Kept in the events table only."""


# -- futures -------------------------------------------------------------------------------


def _future_model(rows: Rows, request_id: str) -> Optional[str]:
    row = rows.get("futures", request_id)
    return row["model_id"] if row is not None else None


@handles(training_events.CREATE_MODEL["requested"])
def _create_model_requested(rows: Rows, event: Event) -> None:
    if fold_future(rows, event) is FutureState.PENDING:
        insert_run(rows, event, cast(training_events.CreateModelRequested, event.data).model_id)


@handles(training_events.LOAD_WEIGHTS["requested"])
def _load_requested(rows: Rows, event: Event) -> None:
    data = cast(training_events.LoadWeightsRequested, event.data)
    state = fold_future(rows, event)
    if data.session_id is not None and state is FutureState.PENDING:
        insert_run(rows, event, data.model_id)
    elif data.seq_id is not None:
        touch_run(rows, data.model_id, event.time)


@handles(
    training_events.FORWARD_BACKWARD["requested"],
    training_events.OPTIM_STEP["requested"],
    training_events.SAVE_WEIGHTS["requested"],
    training_events.SAVE_WEIGHTS_FOR_SAMPLER["requested"],
)
def _training_requested(rows: Rows, event: Event) -> None:
    fold_future(rows, event)
    touch_run(rows, cast(_TrainingRequest, event.data).model_id, event.time)


@handles(
    *(
        family[phase]
        for family in (training_events.CREATE_MODEL, training_events.LOAD_WEIGHTS)
        for phase in ("completed", "failed")
    )
)
def _model_lifecycle(rows: Rows, event: Event) -> None:
    if fold_future(rows, event) is None:
        return
    data = cast(Union[RequestCompleted, RequestFailed], event.data)
    model_id = _future_model(rows, data.request_id)
    run = rows.get("training_runs", model_id)
    if run is None or model_id is None or run["state"] != "creating":
        return
    if isinstance(data, RequestFailed):
        touch_run(rows, model_id, event.time, state="failed", error=data.error)
    else:
        touch_run(rows, model_id, event.time, state="ready")


@handles(training_events.SAVE_WEIGHTS["completed"], training_events.SAVE_WEIGHTS_FOR_SAMPLER["completed"])
def _saved(rows: Rows, event: Event) -> None:
    # CANCELLED: its run was cancelled before the trainer got to it; what it saved is not kept.
    if fold_future(rows, event) in (None, FutureState.CANCELLED):
        return
    data = cast(RequestCompleted, event.data)
    if data.checkpoint is not None:
        upsert_checkpoint(rows, event, data.checkpoint)
    if data.sampling_session is not None:
        run_id = _future_model(rows, data.request_id)
        _insert_sampling_session(rows, event, data.sampling_session, run_id=run_id)


# -- sampling ------------------------------------------------------------------------------


def _insert_sampling_session(
    rows: Rows, event: Event, bound: SamplingSessionBound, run_id: Optional[str] = None
) -> None:
    if rows.get("sampling_sessions", bound.sampling_session_id) is not None:
        return
    rows.insert(
        "sampling_sessions",
        sampling_session_id=bound.sampling_session_id,
        tenant=event.tenant,
        session_id=bound.session_id,
        base_model=bound.base_model,
        model_path=bound.model_path,
        adapter={name: ref.model_dump() for name, ref in bound.adapter.items()} if bound.adapter else None,
        weights=bound.weights.model_dump() if bound.weights else None,
        created_at=event.time,
        run_id=run_id,
    )


@handles(sampling_events.SAMPLING_SESSION_CREATED)
def _sampling_session_created(rows: Rows, event: Event) -> None:
    data = cast(sampling_events.SamplingSessionCreated, event.data)
    bound = SamplingSessionBound(
        sampling_session_id=data.sampling_session_id,
        session_id=data.session_id,
        base_model=data.base_model,
        model_path=data.model_path,
        adapter=data.adapter,
        weights=data.weights,
    )
    run_id = TinkerPath.parse(data.model_path).run_id if data.model_path else None
    _insert_sampling_session(rows, event, bound, run_id=run_id)


def expiry(ttl_seconds: Optional[int], now: datetime) -> Optional[datetime]:
    return now + timedelta(seconds=ttl_seconds) if ttl_seconds else None


# -- checkpoint records: exports, removal, visibility, expiry, copies ---------------------
# (the save handlers above make records; these change or remove them)

handles(training_events.SAVE_WEIGHTS_EXTERNAL["requested"])(_training_requested)


@handles(training_events.SAVE_WEIGHTS_EXTERNAL["completed"])
def _exported(rows: Rows, event: Event) -> None:
    # Not `_saved`: an export is neither the run's last training nor its last sampler checkpoint.
    data = cast(RequestCompleted, event.data)
    if fold_future(rows, event) in (None, FutureState.CANCELLED) or data.checkpoint is None:
        return
    put_checkpoint(rows, event.tenant, data.checkpoint, event.time, event.id)
    touch_run(rows, data.checkpoint.run_id, event.time)


_LAST_COLUMN = {"weights": "last_checkpoint", "sampler_weights": "last_sampler_checkpoint"}


def _refresh_last(rows: Rows, run_id: str, kind: str) -> None:
    """Point the run's last_* column at its newest remaining checkpoint of that kind (the
    name breaks a tie of equal times, in code point order)."""
    column = _LAST_COLUMN.get(kind)
    if column is None:
        return
    remaining = rows.select("checkpoints", run_id=run_id, kind=kind)
    newest = min(remaining, key=lambda row: (-row["created_at"].timestamp(), row["checkpoint_id"]), default=None)
    rows.update("training_runs", (run_id,), **{column: newest["checkpoint_id"] if newest is not None else None})


@handles(checkpoint_events.CHECKPOINT_DELETED, checkpoint_events.CHECKPOINT_EXPIRED)
def _checkpoint_removed(rows: Rows, event: Event) -> None:
    data = cast(checkpoint_events.CheckpointRemoved, event.data)
    row = rows.get("checkpoints", data.run_id, data.checkpoint_id)
    if row is None:
        return
    if event.type == checkpoint_events.CHECKPOINT_EXPIRED and utc(row["expires_at"]) != utc(data.expires_at):
        # The owner moved the expiry (or saved anew) after the reaper looked: not expired.
        return
    kind = row["kind"]
    record_removal(rows, row, event.time, event.id)
    rows.delete("checkpoints", (data.run_id, data.checkpoint_id))
    _refresh_last(rows, data.run_id, kind)


@handles(checkpoint_events.CHECKPOINT_PUBLISHED, checkpoint_events.CHECKPOINT_UNPUBLISHED)
def _checkpoint_visibility(rows: Rows, event: Event) -> None:
    public = event.type == checkpoint_events.CHECKPOINT_PUBLISHED
    data = cast(checkpoint_events.CheckpointVisibility, event.data)
    rows.update("checkpoints", (data.run_id, data.checkpoint_id), public=public)


@handles(checkpoint_events.CHECKPOINT_TTL_SET)
def _checkpoint_ttl(rows: Rows, event: Event) -> None:
    data = cast(checkpoint_events.CheckpointTtlSet, event.data)
    rows.update("checkpoints", (data.run_id, data.checkpoint_id), expires_at=data.expires_at)


@handles(checkpoint_events.CHECKPOINT_COPIED)
def _checkpoint_copied(rows: Rows, event: Event) -> None:
    data = cast(checkpoint_events.CheckpointCopied, event.data)
    saved = data.checkpoint
    if data.new_session_project_id is not None and rows.get("sessions", data.session_id) is None:
        rows.insert(
            "sessions",
            session_id=data.session_id,
            tenant=event.tenant,
            tags=["copy_weights"],
            user_metadata={},
            project_id=data.new_session_project_id,
            display_name=f"copy of {data.source_path}",
            created_at=event.time,
            finished_at=event.time,
            finish_reason="copy",
        )
    if rows.get("training_runs", saved.run_id) is None:
        # Not "ready": nothing trains a copy's run (no trainer ever created its adapter).
        insert_run(rows, event, saved.run_id, state="frozen")
    put_checkpoint(rows, event.tenant, saved, event.time, event.id)
    _refresh_last(rows, saved.run_id, saved.kind)


# -- sample cancellation -----------------------------------------------------------------


@handles(sampling_events.SAMPLE_CANCEL_REQUESTED)
def _sample_cancel_requested(rows: Rows, event: Event) -> None:
    """Kept in the events table only: the sampler decides, and its answer moves the future."""


@handles(sampling_events.SAMPLE_CANCELLED)
def _sample_cancelled(rows: Rows, event: Event) -> None:
    # Only a future that was still unfinished ends CANCELLED (the fold absorbs the rest), and
    # only then is its completion time set.
    data = cast(sampling_events.SampleCancelled, event.data)
    row = rows.get("futures", data.request_id)
    before = row["state"] if row is not None else None
    if fold_future(rows, event) is FutureState.CANCELLED and before != FutureState.CANCELLED.value:
        rows.update("futures", (data.request_id,), error=data.reason, category="user", completed_at=event.time)


# Steps and cancellation fold in a module of their own; importing it registers its handlers.
from eventing.store import run_projections  # noqa: E402,F401
