"""What one audit line says about one event: who did what to which objects, and how it ended.

`entry_for(event)` is a pure function from a typed event to a JSON-ready dict. The line
names the event (id, type, time), the actor (the tenant and the function that emitted the
event, its CloudEvent `source`), the objects the event touches (session, model, sampling
session, request, training run, checkpoint) and, for a terminal phase, a short outcome
(failure category, checkpoint path, cancel reason). It never carries a payload's tensors,
token lists, results or user metadata: only ids, small scalars and the lengths of lists, so
an audit file stays small and holds no training data.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel

from openrl_core.events import Event
from openrl_core.events.lifecycle import CheckpointSaved, RequestCompleted, RequestFailed, SamplingSessionBound

# The payload fields that name an object; everything an auditor filters by.
ID_FIELDS = ("request_id", "session_id", "model_id", "sampling_session_id", "run_id", "checkpoint_id", "project_id")
# Scalars worth a line (what was asked for), each short enough to keep a line small.
DETAIL_FIELDS = (
    "base_model", "seq_id", "model_seq_id", "loss_fn", "forward_only", "name", "kind", "path", "source_path",
    "with_optimizer", "num_samples", "ttl_seconds", "overwrite", "destination", "new_session_project_id",
    "sampling_session_seq_id", "next_seq", "event_count", "sdk_version", "method", "route",
)  # fmt: skip
# Lists are recorded by their length only: they hold training data or tokens.
COUNTED_FIELDS = ("data", "prompt_tokens", "sample_sequence_ids", "tags")
TERMINAL_PHASES = ("completed", "failed", "cancelled", "skipped", "refused")
ERROR_CHARS = 300  # a failure's message is cut here: enough to say what went wrong
DETAIL_CHARS = 200


def entry_for(event: Event) -> dict[str, Any]:
    data = event.data
    entry: dict[str, Any] = {
        "time": event.time.isoformat(),
        "id": event.id,
        "type": event.type,
        "actor": {"tenant": event.tenant, "source": event.source},
        "ids": _ids(event),
    }
    detail = _detail(data)
    if detail:
        entry["detail"] = detail
    if event.phase in TERMINAL_PHASES:
        entry["outcome"] = _outcome(event)
    return entry


def _ids(event: Event) -> dict[str, str]:
    data = event.data
    ids = {name: str(value) for name in ID_FIELDS if (value := getattr(data, name, None)) is not None}
    checkpoint = _checkpoint(data)
    if checkpoint is not None:
        ids.setdefault("run_id", checkpoint.run_id)
        ids.setdefault("checkpoint_id", checkpoint.checkpoint_id)
    bound = getattr(data, "sampling_session", None)
    if isinstance(bound, SamplingSessionBound):
        ids.setdefault("sampling_session_id", bound.sampling_session_id)
    # Completion payloads name only the request; the partition key names the model or
    # sampling session it belongs to, which is what "who touched what" needs.
    if event.key and event.key not in ids.values():
        ids["key"] = event.key
    return ids


def _detail(data: BaseModel) -> dict[str, Any]:
    detail: dict[str, Any] = {}
    for name in DETAIL_FIELDS:
        value = getattr(data, name, None)
        if value is None:
            continue
        detail[name] = _short(value)
    for name in COUNTED_FIELDS:
        value = getattr(data, name, None)
        if isinstance(value, list):
            detail[f"{name}_count"] = len(value)
    lora = getattr(data, "lora_config", None)
    if lora is not None:
        detail["lora_rank"] = getattr(lora, "rank", None)
    return detail


def _outcome(event: Event) -> dict[str, Any]:
    data = event.data
    if isinstance(data, RequestFailed):
        return {"status": "failed", "category": data.category, "error": _short(data.error, ERROR_CHARS)}
    status = {"cancelled": "cancelled", "skipped": "skipped", "refused": "refused"}.get(event.phase, "completed")
    outcome: dict[str, Any] = {"status": status}
    checkpoint = _checkpoint(data)
    if checkpoint is not None:
        outcome["checkpoint"] = checkpoint.tinker_path
    elif (run_id := getattr(data, "run_id", None)) and (checkpoint_id := getattr(data, "checkpoint_id", None)):
        outcome["checkpoint"] = f"tinker://{run_id}/{checkpoint_id}"
    if isinstance(data, RequestCompleted) and data.sampling_session is not None:
        outcome["sampling_session_id"] = data.sampling_session.sampling_session_id
    reason = getattr(data, "reason", None)
    if reason:
        outcome["reason"] = _short(reason)
    return outcome


def _checkpoint(data: BaseModel) -> Optional[CheckpointSaved]:
    checkpoint = getattr(data, "checkpoint", None)
    return checkpoint if isinstance(checkpoint, CheckpointSaved) else None


def _short(value: Any, limit: int = DETAIL_CHARS) -> Any:
    if isinstance(value, (bool, int, float)):
        return value
    text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
