"""The projections' handler registry and the row helpers every projection module shares.

`projections` (sessions, futures, checkpoints, sampling) and `run_projections` (steps,
cancellation, forks) both register their handlers here (`handles`) and build on the same
helpers: the fold of a lifecycle event into its future (`fold_future`, after the pure state
machine in `openrl_core.futures`), a run's row (`insert_run`, `touch_run`) and a checkpoint
record (`put_checkpoint`, `upsert_checkpoint`). This module imports neither of them, so
the two depend on it and not on each other. Invariants: one handler per event type (a
second registration of a type is an error, not a silent override); a late or repeated
lifecycle event leaves a finished future as it is; every write goes through the
transaction's unit of work (`Rows`), never SQL of its own.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Callable, Optional, Protocol, Union, cast

from eventing.store.unit_of_work import Rows
from openrl_core.billing import prefill_tokens, sampled_tokens
from openrl_core.events import Event
from openrl_core.events import checkpoints as checkpoint_events
from openrl_core.events import training as training_events
from openrl_core.events.lifecycle import CheckpointSaved, RequestCompleted, RequestFailed
from openrl_core.futures import FutureState, Phase, evolve
from openrl_core.ids import CHECKPOINT_TYPE, session_of
from openrl_core.quotas import request_tokens

Handler = Callable[[Rows, Event], None]
HANDLERS: dict[str, Handler] = {}


class _MovesFuture(Protocol):
    """A payload whose event moves a future: a request, or its started, completed or failed."""

    request_id: str


# The payloads a run's row is made from (`insert_run`).
_MakesRun = Union[
    training_events.CreateModelRequested,
    training_events.LoadWeightsRequested,
    training_events.ForkRequested,
    checkpoint_events.CheckpointCopied,
]


def handles(*types: str):
    def register(fn: Handler) -> Handler:
        for type_ in types:
            if HANDLERS.get(type_, fn) is not fn:  # two folds of one event: the later would win silently
                raise ValueError(f"{type_} already has a projection ({HANDLERS[type_].__qualname__})")
            HANDLERS[type_] = fn
        return fn

    return register


# By value, as the enums' own lookup finds them, without its call (every lifecycle event
# makes two: a replay's fold spent about 3% of its time there).
PHASES = {phase.value: phase for phase in Phase}
STATES = {state.value: state for state in FutureState}


def fold_future(rows: Rows, event: Event) -> Optional[FutureState]:
    """Fold a lifecycle event into its future; returns the new state (None: no such future)."""
    request_id = cast(_MovesFuture, event.data).request_id
    phase = PHASES[event.phase]
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
            prefill_tokens=prefill_tokens(data),
        )
        return FutureState.PENDING
    before = STATES[row["state"]]
    after = evolve(before, phase)
    if after == before:
        return after
    values: dict = {"state": after.value}
    if isinstance(event.data, RequestCompleted):
        values.update(result=event.data.result, completed_at=event.time)
        if row["kind"] == "sample":
            values["sampled_tokens"] = sampled_tokens(event.data.result)
    elif isinstance(event.data, RequestFailed):
        values.update(error=event.data.error, category=event.data.category, completed_at=event.time)
    rows.update("futures", (request_id,), **values)
    return after


def touch_run(rows: Rows, model_id: str, when: datetime, **values) -> None:
    rows.update("training_runs", (model_id,), last_request_time=when, **values)


def insert_run(rows: Rows, event: Event, model_id: str, state: str = "creating") -> None:
    """A run's row from the request that makes it (create_model, load_weights, copy_weights)."""
    data = cast(_MakesRun, event.data)
    full = bool(getattr(data, "full_finetune", False))
    rows.insert(
        "training_runs",
        model_id=model_id,
        tenant=event.tenant,
        session_id=data.session_id,
        base_model=data.base_model,
        is_lora=not full,
        lora_rank=None if full or data.lora_config is None else data.lora_config.rank,
        lora_config=None if full or data.lora_config is None else data.lora_config.model_dump(),
        user_metadata=data.user_metadata,
        state=state,
        created_at=event.time,
        last_request_time=event.time,
    )


def upsert_checkpoint(rows: Rows, event: Event, saved: CheckpointSaved) -> None:
    put_checkpoint(rows, event.tenant, saved, event.time, event.id)
    column = "last_checkpoint" if CHECKPOINT_TYPE[saved.kind] == "training" else "last_sampler_checkpoint"
    touch_run(rows, saved.run_id, event.time, **{column: saved.checkpoint_id})


def put_checkpoint(rows: Rows, tenant: str, saved: CheckpointSaved, when: datetime, event_id: str) -> None:
    """Insert the record, or replace a same-named one's content (its public flag stays)."""
    values: dict[str, Any] = dict(
        tenant=tenant,
        kind=saved.kind,
        tinker_path=saved.tinker_path,
        files={name: ref.model_dump() for name, ref in saved.files.items()},
        size_bytes=saved.size_bytes,
        created_at=when,
        expires_at=saved.expires_at,
        user_metadata=saved.user_metadata,
    )
    existing = rows.get("checkpoints", saved.run_id, saved.checkpoint_id)
    if existing is None:
        rows.insert("checkpoints", run_id=saved.run_id, checkpoint_id=saved.checkpoint_id, public=False, **values)
    else:
        record_removal(rows, existing, when, event_id)  # the replaced content stopped being stored now
        rows.update("checkpoints", (saved.run_id, saved.checkpoint_id), **values)


def record_removal(rows: Rows, row: dict, when: datetime, event_id: str) -> None:
    """Keep a checkpoint's stored interval as it leaves `checkpoints` (deleted, expired or
    replaced), for billing's storage: from its save until `when`, or its expiry if earlier.
    Keyed by the removing event's id: one event removes at most one checkpoint."""
    expires = row["expires_at"]
    until = min(when, expires) if expires is not None else when
    if until < row["created_at"]:
        until = row["created_at"]
    rows.insert(
        "removed_checkpoints",
        removed_by=event_id,
        tenant=row["tenant"],
        run_id=row["run_id"],
        checkpoint_id=row["checkpoint_id"],
        saved_at=row["created_at"],
        removed_at=until,
        size_bytes=row["size_bytes"],
    )
