"""Projections: how each event changes the read tables, applied in the event's transaction.

Each handler is a small function of (connection, event). Futures follow the pure state
machine in `openrl_core.futures`; a late or repeated lifecycle event leaves a finished
future as it is. Replaying the events table through `apply` rebuilds every table exactly.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Callable, Optional

from sqlalchemy import and_, bindparam, delete, insert, select, update
from sqlalchemy.engine import Connection

from eventing.store import tables as t
from openrl_core.events import Event
from openrl_core.events import access as access_events
from openrl_core.events import checkpoints as checkpoint_events
from openrl_core.events import sampling as sampling_events
from openrl_core.events import sessions as session_events
from openrl_core.events import training as training_events
from openrl_core.events.recovery import SNAPSHOT_TAKEN
from openrl_core.events.lifecycle import CheckpointSaved, RequestCompleted, RequestFailed, SamplingSessionBound
from openrl_core.futures import FutureState, Phase, evolve
from openrl_core.ids import CHECKPOINT_TYPE, TinkerPath, session_of
from openrl_core.quotas import request_tokens

Handler = Callable[[Connection, Event], None]
_HANDLERS: dict[str, Handler] = {}


def handles(*types: str):
    def register(fn: Handler) -> Handler:
        for type_ in types:
            _HANDLERS[type_] = fn
        return fn

    return register


def apply(conn: Connection, event: Event) -> None:
    handler = _HANDLERS.get(event.type)
    if handler is not None:
        handler(conn, event)
    elif event.phase in ("requested", "started", "completed", "failed"):
        _future(conn, event)


def utc(value: Optional[datetime]) -> Optional[datetime]:
    """SQLite hands datetimes back naive; everything stored here is UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=timezone.utc)


# -- sessions ------------------------------------------------------------------------------


@handles(session_events.SESSION_CREATED)
def _session_created(conn: Connection, event: Event) -> None:
    data = event.data
    conn.execute(
        insert(t.sessions).values(
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
    )


@handles(session_events.SESSION_HEARTBEAT)
def _session_heartbeat(conn: Connection, event: Event) -> None:
    conn.execute(
        update(t.sessions).where(t.sessions.c.session_id == event.data.session_id).values(last_heartbeat_at=event.time)
    )


@handles(session_events.SESSION_FINISHED)
def _session_finished(conn: Connection, event: Event) -> None:
    conn.execute(
        update(t.sessions)
        .where(t.sessions.c.session_id == event.data.session_id)
        .values(finished_at=event.time, finish_reason=event.data.reason)
    )


@handles(session_events.TELEMETRY_RECEIVED, training_events.SEQ_SKIPPED, SNAPSHOT_TAKEN, access_events.LOOKUP_REFUSED)
def _no_projection(conn: Connection, event: Event) -> None:
    """Kept in the events table only."""


# -- futures -------------------------------------------------------------------------------


# The hot statements are built once with bind parameters: building one per event (with its
# values as literals) cost more than running it, and replay runs them once per event.
_FUTURE_STATE = select(t.futures.c.state).where(t.futures.c.request_id == bindparam("b_request_id"))
_FUTURE_UPDATE = update(t.futures).where(t.futures.c.request_id == bindparam("b_request_id"))
_FUTURE_INSERT = insert(t.futures)
_RUN_UPDATE = update(t.training_runs).where(t.training_runs.c.model_id == bindparam("b_model_id"))


def _future(conn: Connection, event: Event) -> Optional[FutureState]:
    """Fold a lifecycle event into its future; returns the new state (None: no such future)."""
    request_id = event.data.request_id
    phase = Phase(event.phase)
    row = conn.execute(_FUTURE_STATE, {"b_request_id": request_id}).first()
    if row is None:
        if phase is not Phase.REQUESTED:
            return None
        data = event.data
        model_id = getattr(data, "model_id", None) or getattr(data, "sampling_session_id", None)
        session_id = getattr(data, "session_id", None) or (session_of(model_id) if model_id else None)
        conn.execute(
            _FUTURE_INSERT,
            dict(
                request_id=request_id,
                tenant=event.tenant,
                kind=event.verb,
                session_id=session_id,
                model_id=model_id,
                state=evolve(None, phase).value,
                created_at=event.time,
                tokens=request_tokens(data),
            ),
        )
        return FutureState.PENDING
    before = FutureState(row.state)
    after = evolve(before, phase)
    if after == before:
        return after
    values: dict = {"state": after.value}
    if isinstance(event.data, RequestCompleted):
        values.update(result=event.data.result, completed_at=event.time)
    elif isinstance(event.data, RequestFailed):
        values.update(error=event.data.error, category=event.data.category, completed_at=event.time)
    conn.execute(_FUTURE_UPDATE, {"b_request_id": request_id, **values})
    return after


def _touch_run(conn: Connection, model_id: str, when: datetime, **values) -> None:
    conn.execute(_RUN_UPDATE, {"b_model_id": model_id, "last_request_time": when, **values})


def _insert_run(conn: Connection, event: Event, model_id: str, state: str = "creating") -> None:
    """A run's row from the request that makes it (create_model, load_weights, copy_weights)."""
    data = event.data
    full = bool(getattr(data, "full_finetune", False))
    conn.execute(
        insert(t.training_runs).values(
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
    )


@handles(training_events.CREATE_MODEL["requested"])
def _create_model_requested(conn: Connection, event: Event) -> None:
    if _future(conn, event) is FutureState.PENDING:
        _insert_run(conn, event, event.data.model_id)


@handles(training_events.LOAD_WEIGHTS["requested"])
def _load_requested(conn: Connection, event: Event) -> None:
    state = _future(conn, event)
    if event.data.session_id is not None and state is FutureState.PENDING:
        _insert_run(conn, event, event.data.model_id)
    elif event.data.seq_id is not None:
        _touch_run(conn, event.data.model_id, event.time)


@handles(
    training_events.FORWARD_BACKWARD["requested"],
    training_events.OPTIM_STEP["requested"],
    training_events.SAVE_WEIGHTS["requested"],
    training_events.SAVE_WEIGHTS_FOR_SAMPLER["requested"],
)
def _training_requested(conn: Connection, event: Event) -> None:
    _future(conn, event)
    _touch_run(conn, event.data.model_id, event.time)


@handles(*(family[phase] for family in (training_events.CREATE_MODEL, training_events.LOAD_WEIGHTS) for phase in ("completed", "failed")))
def _model_lifecycle(conn: Connection, event: Event) -> None:
    if _future(conn, event) is None:
        return
    model_id = conn.execute(select(t.futures.c.model_id).where(t.futures.c.request_id == event.data.request_id)).scalar()
    run = conn.execute(select(t.training_runs.c.state).where(t.training_runs.c.model_id == model_id)).first()
    if run is None or run.state != "creating":
        return
    if isinstance(event.data, RequestFailed):
        _touch_run(conn, model_id, event.time, state="failed", error=event.data.error)
    else:
        _touch_run(conn, model_id, event.time, state="ready")


@handles(training_events.SAVE_WEIGHTS["completed"], training_events.SAVE_WEIGHTS_FOR_SAMPLER["completed"])
def _saved(conn: Connection, event: Event) -> None:
    # CANCELLED: its run was cancelled before the trainer got to it; what it saved is not kept.
    if _future(conn, event) in (None, FutureState.CANCELLED):
        return
    if event.data.checkpoint is not None:
        _upsert_checkpoint(conn, event, event.data.checkpoint)
    if event.data.sampling_session is not None:
        run_id = conn.execute(select(t.futures.c.model_id).where(t.futures.c.request_id == event.data.request_id)).scalar()
        _insert_sampling_session(conn, event, event.data.sampling_session, seq=None, run_id=run_id)


def _upsert_checkpoint(conn: Connection, event: Event, saved: CheckpointSaved) -> None:
    _put_checkpoint(conn, event.tenant, saved, event.time)
    column = "last_checkpoint" if CHECKPOINT_TYPE[saved.kind] == "training" else "last_sampler_checkpoint"
    _touch_run(conn, saved.run_id, event.time, **{column: saved.checkpoint_id})


# -- sampling ------------------------------------------------------------------------------


def _insert_sampling_session(
    conn: Connection, event: Event, bound: SamplingSessionBound, seq: Optional[int], run_id: Optional[str] = None
) -> None:
    exists = conn.execute(
        select(t.sampling_sessions.c.sampling_session_id).where(
            t.sampling_sessions.c.sampling_session_id == bound.sampling_session_id
        )
    ).first()
    if exists is not None:
        return
    conn.execute(
        insert(t.sampling_sessions).values(
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
    )


@handles(sampling_events.SAMPLING_SESSION_CREATED)
def _sampling_session_created(conn: Connection, event: Event) -> None:
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
    _insert_sampling_session(conn, event, bound, data.sampling_session_seq_id, run_id=run_id)


def expiry(ttl_seconds: Optional[int], now: datetime) -> Optional[datetime]:
    return now + timedelta(seconds=ttl_seconds) if ttl_seconds else None


# -- checkpoint records: exports, removal, visibility, expiry, copies ---------------------
# (the save handlers above make records; these change or remove them)

handles(training_events.SAVE_WEIGHTS_EXTERNAL["requested"])(_training_requested)


@handles(training_events.SAVE_WEIGHTS_EXTERNAL["completed"])
def _exported(conn: Connection, event: Event) -> None:
    # Not `_saved`: an export is neither the run's last training nor its last sampler checkpoint.
    if _future(conn, event) in (None, FutureState.CANCELLED) or event.data.checkpoint is None:
        return
    _put_checkpoint(conn, event.tenant, event.data.checkpoint, event.time)
    _touch_run(conn, event.data.checkpoint.run_id, event.time)


def _checkpoint_key(run_id: str, checkpoint_id: str):
    return and_(t.checkpoints.c.run_id == run_id, t.checkpoints.c.checkpoint_id == checkpoint_id)


def _put_checkpoint(conn: Connection, tenant: str, saved: CheckpointSaved, when: datetime) -> None:
    """Insert the record, or replace a same-named one's content (its public flag stays)."""
    key = _checkpoint_key(saved.run_id, saved.checkpoint_id)
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
    if conn.execute(select(t.checkpoints.c.run_id).where(key)).first() is None:
        conn.execute(insert(t.checkpoints).values(run_id=saved.run_id, checkpoint_id=saved.checkpoint_id, public=False, **values))
    else:
        conn.execute(update(t.checkpoints).where(key).values(**values))


_LAST_COLUMN = {"weights": "last_checkpoint", "sampler_weights": "last_sampler_checkpoint"}


def _refresh_last(conn: Connection, run_id: str, kind: str) -> None:
    """Point the run's last_* column at its newest remaining checkpoint of that kind."""
    column = _LAST_COLUMN.get(kind)
    if column is None:
        return
    newest = conn.execute(
        select(t.checkpoints.c.checkpoint_id)
        .where(t.checkpoints.c.run_id == run_id, t.checkpoints.c.kind == kind)
        .order_by(t.checkpoints.c.created_at.desc(), t.checkpoints.c.checkpoint_id)
        .limit(1)
    ).scalar()
    conn.execute(update(t.training_runs).where(t.training_runs.c.model_id == run_id).values(**{column: newest}))


@handles(checkpoint_events.CHECKPOINT_DELETED, checkpoint_events.CHECKPOINT_EXPIRED)
def _checkpoint_removed(conn: Connection, event: Event) -> None:
    data = event.data
    key = _checkpoint_key(data.run_id, data.checkpoint_id)
    row = conn.execute(select(t.checkpoints.c.kind, t.checkpoints.c.expires_at).where(key)).first()
    if row is None:
        return
    if event.type == checkpoint_events.CHECKPOINT_EXPIRED and utc(row.expires_at) != utc(data.expires_at):
        # The owner moved the expiry (or saved anew) after the reaper looked: not expired.
        return
    conn.execute(delete(t.checkpoints).where(key))
    _refresh_last(conn, data.run_id, row.kind)


@handles(checkpoint_events.CHECKPOINT_PUBLISHED, checkpoint_events.CHECKPOINT_UNPUBLISHED)
def _checkpoint_visibility(conn: Connection, event: Event) -> None:
    public = event.type == checkpoint_events.CHECKPOINT_PUBLISHED
    conn.execute(update(t.checkpoints).where(_checkpoint_key(event.data.run_id, event.data.checkpoint_id)).values(public=public))


@handles(checkpoint_events.CHECKPOINT_TTL_SET)
def _checkpoint_ttl(conn: Connection, event: Event) -> None:
    key = _checkpoint_key(event.data.run_id, event.data.checkpoint_id)
    conn.execute(update(t.checkpoints).where(key).values(expires_at=event.data.expires_at))


@handles(checkpoint_events.CHECKPOINT_COPIED)
def _checkpoint_copied(conn: Connection, event: Event) -> None:
    data = event.data
    saved = data.checkpoint
    if data.new_session_project_id is not None and conn.execute(
        select(t.sessions.c.session_id).where(t.sessions.c.session_id == data.session_id)
    ).first() is None:
        conn.execute(
            insert(t.sessions).values(
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
        )
    if conn.execute(select(t.training_runs.c.model_id).where(t.training_runs.c.model_id == saved.run_id)).first() is None:
        # Not "ready": nothing trains a copy's run (no trainer ever created its adapter).
        _insert_run(conn, event, saved.run_id, state="frozen")
    _put_checkpoint(conn, event.tenant, saved, event.time)
    _refresh_last(conn, saved.run_id, saved.kind)


# -- sample cancellation -----------------------------------------------------------------


@handles(sampling_events.SAMPLE_CANCEL_REQUESTED)
def _sample_cancel_requested(conn: Connection, event: Event) -> None:
    """Kept in the events table only: the sampler decides, and its answer moves the future."""


@handles(sampling_events.SAMPLE_CANCELLED)
def _sample_cancelled(conn: Connection, event: Event) -> None:
    # Only a future that was still unfinished ends CANCELLED (the fold absorbs the rest), and
    # only then is its completion time set.
    before = conn.execute(select(t.futures.c.state).where(t.futures.c.request_id == event.data.request_id)).scalar()
    if _future(conn, event) is FutureState.CANCELLED and before != FutureState.CANCELLED.value:
        conn.execute(
            update(t.futures)
            .where(t.futures.c.request_id == event.data.request_id)
            .values(error=event.data.reason, category="user", completed_at=event.time)
        )


# Steps and cancellation fold in a module of their own; importing it registers its handlers.
from eventing.store import run_projections  # noqa: E402,F401
