"""Projections: how each event changes the read tables, folded in the event's transaction.

Each handler is a small function of (rows, event) that reads and writes rows through the
transaction's unit of work (`eventing.store.unit_of_work.Rows`), never SQL of its own, so a
batch of events costs a few statements in all. Futures follow the pure state machine in
`openrl_core.futures`; a late or repeated lifecycle event leaves a finished future as it is.
Replaying the events table through `apply` rebuilds every table exactly.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Callable, Optional

from eventing.store.unit_of_work import Rows, utc
from openrl_core.events import Event
from openrl_core.events import access as access_events
from openrl_core.events import checkpoints as checkpoint_events
from openrl_core.events import sampling as sampling_events
from openrl_core.events import sessions as session_events
from openrl_core.events import training as training_events
from openrl_core.events.lifecycle import CheckpointSaved, RequestCompleted, RequestFailed, SamplingSessionBound
from openrl_core.events.recovery import SNAPSHOT_TAKEN
from openrl_core.futures import FutureState, Phase, evolve
from openrl_core.ids import CHECKPOINT_TYPE, TinkerPath, session_of
from openrl_core.quotas import request_tokens

__all__ = ["apply", "expiry", "utc"]

Handler = Callable[[Rows, Event], None]
_HANDLERS: dict[str, Handler] = {}


def handles(*types: str):
    def register(fn: Handler) -> Handler:
        for type_ in types:
            _HANDLERS[type_] = fn
        return fn

    return register


def apply(rows: Rows, event: Event) -> None:
    handler = _HANDLERS.get(event.type)
    if handler is not None:
        handler(rows, event)
    elif event.phase in ("requested", "started", "completed", "failed"):
        _future(rows, event)


# -- sessions ------------------------------------------------------------------------------


@handles(session_events.SESSION_CREATED)
def _session_created(rows: Rows, event: Event) -> None:
    data = event.data
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
    rows.update("sessions", (event.data.session_id,), last_heartbeat_at=event.time)


@handles(session_events.SESSION_FINISHED)
def _session_finished(rows: Rows, event: Event) -> None:
    rows.update("sessions", (event.data.session_id,), finished_at=event.time, finish_reason=event.data.reason)


@handles(session_events.SESSION_PROJECT_ASSIGNED)
def _session_project_assigned(rows: Rows, event: Event) -> None:
    rows.update("sessions", (event.data.session_id,), project_id=event.data.project_id)


@handles(session_events.TELEMETRY_RECEIVED, training_events.SEQ_SKIPPED, SNAPSHOT_TAKEN, access_events.LOOKUP_REFUSED)
def _no_projection(rows: Rows, event: Event) -> None:
    """Kept in the events table only."""


# -- futures -------------------------------------------------------------------------------


# By value, as the enums' own lookup finds them, without its call (every lifecycle event
# makes two: a replay's fold spent about 3% of its time there).
_PHASES = {phase.value: phase for phase in Phase}
_STATES = {state.value: state for state in FutureState}


def _future(rows: Rows, event: Event) -> Optional[FutureState]:
    """Fold a lifecycle event into its future; returns the new state (None: no such future)."""
    request_id = event.data.request_id
    phase = _PHASES[event.phase]
    row = rows.get("futures", request_id)
    if row is None:
        if phase is not Phase.REQUESTED:
            return None
        data = event.data
        fields = vars(data)  # what getattr with a default gives, without pydantic's slow path for a missing field
        model_id = fields.get("model_id") or fields.get("sampling_session_id")
        session_id = fields.get("session_id") or (session_of(model_id) if model_id else None)
        rows.insert(
            "futures",
            request_id=request_id,
            tenant=event.tenant,
            kind=event.verb,
            session_id=session_id,
            model_id=model_id,
            state=evolve(None, phase).value,
            created_at=event.time,
            tokens=request_tokens(data),
        )
        return FutureState.PENDING
    before = _STATES[row["state"]]
    after = evolve(before, phase)
    if after == before:
        return after
    values: dict = {"state": after.value}
    if isinstance(event.data, RequestCompleted):
        values.update(result=event.data.result, completed_at=event.time)
    elif isinstance(event.data, RequestFailed):
        values.update(error=event.data.error, category=event.data.category, completed_at=event.time)
    rows.update("futures", (request_id,), **values)
    return after


def _future_model(rows: Rows, request_id: str) -> Optional[str]:
    row = rows.get("futures", request_id)
    return row["model_id"] if row is not None else None


def _touch_run(rows: Rows, model_id: str, when: datetime, **values) -> None:
    rows.update("training_runs", (model_id,), last_request_time=when, **values)


def _insert_run(rows: Rows, event: Event, model_id: str, state: str = "creating") -> None:
    """A run's row from the request that makes it (create_model, load_weights, copy_weights)."""
    data = event.data
    full = bool(getattr(data, "full_finetune", False))
    rows.insert(
        "training_runs",
        model_id=model_id,
        tenant=event.tenant,
        session_id=data.session_id,
        base_model=data.base_model,
        is_lora=not full,
        lora_rank=None if full else data.lora_config.rank,
        lora_config=None if full or data.lora_config is None else data.lora_config.model_dump(),
        user_metadata=data.user_metadata,
        state=state,
        created_at=event.time,
        last_request_time=event.time,
    )


@handles(training_events.CREATE_MODEL["requested"])
def _create_model_requested(rows: Rows, event: Event) -> None:
    if _future(rows, event) is FutureState.PENDING:
        _insert_run(rows, event, event.data.model_id)


@handles(training_events.LOAD_WEIGHTS["requested"])
def _load_requested(rows: Rows, event: Event) -> None:
    state = _future(rows, event)
    if event.data.session_id is not None and state is FutureState.PENDING:
        _insert_run(rows, event, event.data.model_id)
    elif event.data.seq_id is not None:
        _touch_run(rows, event.data.model_id, event.time)


@handles(
    training_events.FORWARD_BACKWARD["requested"],
    training_events.OPTIM_STEP["requested"],
    training_events.SAVE_WEIGHTS["requested"],
    training_events.SAVE_WEIGHTS_FOR_SAMPLER["requested"],
)
def _training_requested(rows: Rows, event: Event) -> None:
    _future(rows, event)
    _touch_run(rows, event.data.model_id, event.time)


@handles(
    *(
        family[phase]
        for family in (training_events.CREATE_MODEL, training_events.LOAD_WEIGHTS)
        for phase in ("completed", "failed")
    )
)
def _model_lifecycle(rows: Rows, event: Event) -> None:
    if _future(rows, event) is None:
        return
    model_id = _future_model(rows, event.data.request_id)
    run = rows.get("training_runs", model_id)
    if run is None or run["state"] != "creating":
        return
    if isinstance(event.data, RequestFailed):
        _touch_run(rows, model_id, event.time, state="failed", error=event.data.error)
    else:
        _touch_run(rows, model_id, event.time, state="ready")


@handles(training_events.SAVE_WEIGHTS["completed"], training_events.SAVE_WEIGHTS_FOR_SAMPLER["completed"])
def _saved(rows: Rows, event: Event) -> None:
    # CANCELLED: its run was cancelled before the trainer got to it; what it saved is not kept.
    if _future(rows, event) in (None, FutureState.CANCELLED):
        return
    if event.data.checkpoint is not None:
        _upsert_checkpoint(rows, event, event.data.checkpoint)
    if event.data.sampling_session is not None:
        run_id = _future_model(rows, event.data.request_id)
        _insert_sampling_session(rows, event, event.data.sampling_session, run_id=run_id)


def _upsert_checkpoint(rows: Rows, event: Event, saved: CheckpointSaved) -> None:
    _put_checkpoint(rows, event.tenant, saved, event.time)
    column = "last_checkpoint" if CHECKPOINT_TYPE[saved.kind] == "training" else "last_sampler_checkpoint"
    _touch_run(rows, saved.run_id, event.time, **{column: saved.checkpoint_id})


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
    data = event.data
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
    if _future(rows, event) in (None, FutureState.CANCELLED) or event.data.checkpoint is None:
        return
    _put_checkpoint(rows, event.tenant, event.data.checkpoint, event.time)
    _touch_run(rows, event.data.checkpoint.run_id, event.time)


def _put_checkpoint(rows: Rows, tenant: str, saved: CheckpointSaved, when: datetime) -> None:
    """Insert the record, or replace a same-named one's content (its public flag stays)."""
    values = dict(
        tenant=tenant,
        kind=saved.kind,
        tinker_path=saved.tinker_path,
        files={name: ref.model_dump() for name, ref in saved.files.items()},
        size_bytes=saved.size_bytes,
        created_at=when,
        expires_at=saved.expires_at,
        user_metadata=saved.user_metadata,
    )
    if rows.get("checkpoints", saved.run_id, saved.checkpoint_id) is None:
        rows.insert("checkpoints", run_id=saved.run_id, checkpoint_id=saved.checkpoint_id, public=False, **values)
    else:
        rows.update("checkpoints", (saved.run_id, saved.checkpoint_id), **values)


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
    data = event.data
    row = rows.get("checkpoints", data.run_id, data.checkpoint_id)
    if row is None:
        return
    if event.type == checkpoint_events.CHECKPOINT_EXPIRED and utc(row["expires_at"]) != utc(data.expires_at):
        # The owner moved the expiry (or saved anew) after the reaper looked: not expired.
        return
    kind = row["kind"]
    rows.delete("checkpoints", (data.run_id, data.checkpoint_id))
    _refresh_last(rows, data.run_id, kind)


@handles(checkpoint_events.CHECKPOINT_PUBLISHED, checkpoint_events.CHECKPOINT_UNPUBLISHED)
def _checkpoint_visibility(rows: Rows, event: Event) -> None:
    public = event.type == checkpoint_events.CHECKPOINT_PUBLISHED
    rows.update("checkpoints", (event.data.run_id, event.data.checkpoint_id), public=public)


@handles(checkpoint_events.CHECKPOINT_TTL_SET)
def _checkpoint_ttl(rows: Rows, event: Event) -> None:
    rows.update("checkpoints", (event.data.run_id, event.data.checkpoint_id), expires_at=event.data.expires_at)


@handles(checkpoint_events.CHECKPOINT_COPIED)
def _checkpoint_copied(rows: Rows, event: Event) -> None:
    data = event.data
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
        _insert_run(rows, event, saved.run_id, state="frozen")
    _put_checkpoint(rows, event.tenant, saved, event.time)
    _refresh_last(rows, saved.run_id, saved.kind)


# -- sample cancellation -----------------------------------------------------------------


@handles(sampling_events.SAMPLE_CANCEL_REQUESTED)
def _sample_cancel_requested(rows: Rows, event: Event) -> None:
    """Kept in the events table only: the sampler decides, and its answer moves the future."""


@handles(sampling_events.SAMPLE_CANCELLED)
def _sample_cancelled(rows: Rows, event: Event) -> None:
    # Only a future that was still unfinished ends CANCELLED (the fold absorbs the rest), and
    # only then is its completion time set.
    row = rows.get("futures", event.data.request_id)
    before = row["state"] if row is not None else None
    if _future(rows, event) is FutureState.CANCELLED and before != FutureState.CANCELLED.value:
        rows.update(
            "futures", (event.data.request_id,), error=event.data.reason, category="user", completed_at=event.time
        )


# Steps and cancellation fold in a module of their own; importing it registers its handlers.
from eventing.store import run_projections  # noqa: E402,F401
