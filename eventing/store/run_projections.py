"""Projections of a run's progress and end: per-step metrics, and cancellation.

Steps: the trainer emits a model's completions in seq order on one partition, so the store
holds them in that order and the fold needs no reordering. A training `forward_backward`
completion adds its `loss:sum` and token count to the run's open `run_steps` row (made by
the first request of the step to complete); the `optim_step` completion closes the row
with the optimizer's metrics. A completion whose future had already ended (a cancelled
run's request that the trainer ran anyway) changes nothing. `forward_only` calls
(`forward`) train nothing and count in no step.

Timing comes from timestamps only: `first_request_at` is when the gateway took the step's
first request, `started_at` when the trainer began it (reported in the completion's
`details`), `completed_at` when its optim_step completed. Across machines these assume
clocks that agree, as replay from the log does.

Cancellation (`training.run.cancelled`): the run's row turns `cancelled`; every unfinished
future of the run, and of each sampling session that samples its weights, ends CANCELLED
with category `user` and a message that starts with "cancelled"; those sampling sessions
are closed. Cancelling a cancelled run changes nothing. All of it is a fold of the events,
so replay rebuilds it exactly.

Forks (`training.fork.requested`): the new run's row (state `creating`, with its parent and
step in `forked_from_run` / `forked_from_step`) and, when the gateway made one for it, its
own session (tagged `fork`, in the parent's project). The completion makes the run `ready`
and records the checkpoint the trainer saved of its state; a failure makes it `failed`.
A completion that finds the future already ended (a redelivery) records nothing.
"""

from __future__ import annotations

from datetime import datetime
from typing import Optional, Union, cast

from eventing.store.projection_rows import STATES, fold_future, handles, insert_run, touch_run, upsert_checkpoint
from eventing.store.unit_of_work import Rows, utc
from openrl_core.events import Event
from openrl_core.events import training as training_events
from openrl_core.events.lifecycle import RequestCompleted, RequestFailed
from openrl_core.futures import FutureState, is_terminal

OPEN = (FutureState.PENDING.value, FutureState.RUNNING.value)


def _moment(value) -> Optional[datetime]:
    if not isinstance(value, str):
        return None
    try:
        return utc(datetime.fromisoformat(value))
    except ValueError:
        return None


def _earliest(*moments: Optional[datetime]) -> Optional[datetime]:
    known = [utc(m) for m in moments if m is not None]
    return min(known) if known else None


@handles(training_events.FORWARD_BACKWARD["completed"], training_events.OPTIM_STEP["completed"])
def _step_progress(rows: Rows, event: Event) -> None:
    data = cast(RequestCompleted, event.data)
    request = rows.get("futures", data.request_id)
    # Read before the fold moves the future on: whether it was still open decides the step.
    if request is not None:
        state, model_id, requested = request["state"], request["model_id"], utc(request["created_at"])
    fold_future(rows, event)
    if request is None or is_terminal(STATES[state]):
        return  # unknown, or already ended (a redelivery, or a cancelled run's late work)
    details = data.details or {}
    metrics = data.result.get("metrics") or {}
    optim = event.verb == "optim_step"
    if not optim and details.get("forward_only"):
        return
    started = _moment(details.get("started"))
    # A run's open step (no optim_step yet) is always its latest: a step opens only when
    # none is open. So the latest row is the one to add to (or tells the next number).
    latest = rows.latest("run_steps", "step", "model_id", model_id)
    row = latest if latest is not None and latest["completed_at"] is None else None
    if row is None:  # the step's first request to complete opens it
        step, loss, tokens, calls = (latest["step"] if latest is not None else 0) + 1, None, 0, 0
        values: dict = dict(first_request_at=requested, started_at=started)
    else:
        step, loss, tokens, calls = row["step"], row["loss"], row["tokens"], row["forward_backward"]
        values = {}
        first, begun = _earliest(row["first_request_at"], requested), _earliest(row["started_at"], started)
        if first != utc(row["first_request_at"]) or begun != utc(row["started_at"]):
            values.update(first_request_at=first, started_at=begun)
    if optim:
        values.update(
            completed_at=event.time,
            learning_rate=_number(metrics.get("optim/lr")),
            grad_norm=_number(metrics.get("optim/grad_norm")),
            metrics=dict(metrics),
        )
    else:
        added = _number(metrics.get("loss:sum"))
        values.update(
            loss=loss if added is None else (loss or 0.0) + added,
            tokens=tokens + int(details.get("tokens") or 0),
            forward_backward=calls + 1,
        )
    if row is None:
        rows.insert(
            "run_steps",
            fresh=True,
            model_id=model_id,
            step=step,
            tenant=event.tenant,
            **{"tokens": 0, "forward_backward": 0, **values},
        )
    else:
        rows.update("run_steps", (model_id, step), **values)


def _number(value) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def cancellation_message(data) -> str:
    who = "an operator" if data.by == "operator" else "its owner"
    reason = "" if data.reason in ("", "cancelled") else f": {data.reason}"
    return f"cancelled: training run {data.model_id!r} was cancelled by {who}{reason}"


@handles(training_events.RUN_CANCELLED)
def _run_cancelled(rows: Rows, event: Event) -> None:
    data = cast(training_events.RunCancelled, event.data)
    run = rows.get("training_runs", data.model_id)
    if run is None or run["tenant"] != event.tenant or run["state"] == "cancelled":
        return
    rows.update(
        "training_runs", (data.model_id,), state="cancelled", cancelled_at=event.time, last_request_time=event.time
    )
    message = cancellation_message(data)
    _cancel_futures(rows, event, [data.model_id], message)
    closing = [
        sampler["sampling_session_id"]
        for sampler in rows.select("sampling_sessions", tenant=event.tenant, run_id=data.model_id)
        if sampler["closed_at"] is None
    ]
    for sampling_session_id in closing:
        rows.update("sampling_sessions", (sampling_session_id,), closed_at=event.time)
    if closing:
        _cancel_futures(rows, event, closing, f"{message}; its sampling sessions were closed")


def _cancel_futures(rows: Rows, event: Event, keys: list[str], message: str) -> None:
    for key in keys:
        for future in rows.select("futures", tenant=event.tenant, model_id=key, state=OPEN):
            rows.update(
                "futures", (future["request_id"],),
                state=FutureState.CANCELLED.value, error=message, category="user", completed_at=event.time,
            )  # fmt: skip


@handles(training_events.FORK["requested"])
def _fork_requested(rows: Rows, event: Event) -> None:
    if fold_future(rows, event) is not FutureState.PENDING:
        return
    data = cast(training_events.ForkRequested, event.data)
    if rows.get("sessions", data.session_id) is None:
        rows.insert(
            "sessions",
            session_id=data.session_id, tenant=event.tenant, tags=["fork"], user_metadata={},
            project_id=data.project_id, display_name=f"fork of {data.parent_id} at step {data.step}",
            created_at=event.time, last_heartbeat_at=event.time,
        )  # fmt: skip
    insert_run(rows, event, data.model_id)
    touch_run(rows, data.model_id, event.time, forked_from_run=data.parent_id, forked_from_step=data.step)


@handles(training_events.FORK["completed"], training_events.FORK["failed"])
def _fork_finished(rows: Rows, event: Event) -> None:
    data = cast(Union[RequestCompleted, RequestFailed], event.data)
    before = rows.get("futures", data.request_id)
    if before is None or is_terminal(FutureState(before["state"])):
        return
    model_id = before["model_id"]
    if fold_future(rows, event) is None:
        return
    run = rows.get("training_runs", model_id)
    if run is None or run["state"] != "creating":
        return  # cancelled while it was being built: it stays cancelled, its state unsaved
    if isinstance(data, RequestFailed):
        touch_run(rows, model_id, event.time, state="failed", error=data.error)
        return
    touch_run(rows, model_id, event.time, state="ready")
    if data.checkpoint is not None:
        upsert_checkpoint(rows, event, data.checkpoint)
