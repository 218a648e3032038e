"""The Tinker audit log (`AdminClient.get_audit_log`) as a pure view of a tenant's stored events.

A self-hosted server keeps every event, so the audit log is a selection of them, not a
record of its own: `line_for(event)` turns one stored event into one `AuditLogEntry` (JSON
ready) or None, and `SOURCES` says which OpenRL event types can give a line, per resource,
so the store reads only those rows. `event_details` is the audit journal's own line for the
event (`openrl_core.audit_entries.entry_for`: ids, small details, outcome; never tensors,
tokens or user metadata), so the two audit views cannot disagree.

Names are `<resource>_<action>`, as the SDK documents. The mapping (OpenRL event type ->
audit event):

- checkpoints: a completed save_state / save_weights_for_sampler that kept a checkpoint, and
  a fork's saved state -> `checkpoint_saved`; save_weights_external -> `checkpoint_exported`;
  copy_weights -> `checkpoint_copied`; delete -> `checkpoint_deleted`; the reaper ->
  `checkpoint_expired`; publish / unpublish -> `checkpoint_published` /
  `checkpoint_unpublished`; set_ttl -> `checkpoint_ttl_set`; and a read of a checkpoint's
  weights -> `checkpoint_read` with a `purpose`: `load_weights` (a load into a run),
  `create_training_client` (a run created from it) or `sampling` (a sampling session made
  from its path). Signed-link downloads are not events (the link is the authorisation) and
  so are not in the log.
- projects: assign_session_project -> `project_assigned`; a session created in a project
  -> `project_session_created`.
- sessions, training runs, sampling sessions and refused lookups, under "all" only:
  `session_created`, `session_finished`, `training_run_created`, `training_run_forked`,
  `training_run_cancelled`, `sampling_session_created`, `access_refused` (a 404 answered
  to the tenant for an id it does not own or that does not exist).
- teams and organizations: a self-hosted server has neither (a tenant is one API key's
  owner, with no members or roles), so those filters always give an empty list.

Per-request compute (forward_backward, optim_step, sample, their started/completed phases)
and heartbeats are workload, not administration: they are no audit entries (the billing
endpoint counts them; the event store keeps them, `openrl events tail`). The deprecated
`model_id` / `tinker_path` are set on checkpoint entries and `purpose` on checkpoint reads
only, as the SDK's field docs say.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from typing import Any, Callable, Optional

from openrl_core.audit_entries import entry_for
from openrl_core.errors import InvalidRequest
from openrl_core.events import Event
from openrl_core.events import access as access_events
from openrl_core.events import checkpoints as checkpoint_events
from openrl_core.events import sampling as sampling_events
from openrl_core.events import sessions as session_events
from openrl_core.events import training as training_events
from openrl_core.events.lifecycle import RequestCompleted

EVENT_TYPES = ("all", "checkpoints", "projects", "teams", "organizations")
# The most entries one answer holds: the day's first ones in time order. The SDK's request has
# no limit or cursor, so a busier day is cut here rather than read whole; a narrower
# event_type gets the rest of the checkpoint or project entries.
MAX_ENTRIES = 5000


@dataclass(frozen=True)
class Line:
    """What one event says in the audit log, besides its time and its journal line."""

    event: str
    resource: str  # "checkpoints", "projects" or "other" (listed under "all" only)
    model_id: Optional[str] = None
    tinker_path: Optional[str] = None
    purpose: Optional[str] = None


Mapper = Callable[[Event], Optional[Line]]


def _saved(name: str) -> Mapper:
    def line(event: Event) -> Optional[Line]:
        data = event.data
        checkpoint = data.checkpoint if isinstance(data, RequestCompleted) else None
        if checkpoint is None:  # an ephemeral sampler save keeps no checkpoint
            return None
        return Line(name, "checkpoints", model_id=checkpoint.run_id, tinker_path=checkpoint.tinker_path)

    return line


def _record(name: str) -> Mapper:
    def line(event: Event) -> Optional[Line]:
        data: Any = event.data
        path = f"tinker://{data.run_id}/{data.checkpoint_id}"
        return Line(name, "checkpoints", model_id=data.run_id, tinker_path=path)

    return line


def _copied(event: Event) -> Line:
    saved = event.data.checkpoint  # type: ignore[attr-defined]
    return Line("checkpoint_copied", "checkpoints", model_id=saved.run_id, tinker_path=saved.tinker_path)


def _loaded(event: Event) -> Line:
    data: Any = event.data
    purpose = "create_training_client" if data.session_id is not None else "load_weights"
    return Line("checkpoint_read", "checkpoints", model_id=data.model_id, tinker_path=data.path, purpose=purpose)


def _sampler(event: Event) -> Line:
    data: Any = event.data
    if data.model_path is None:
        return Line("sampling_session_created", "other")
    return Line("checkpoint_read", "checkpoints", model_id=None, tinker_path=data.model_path, purpose="sampling")


def _session_created(event: Event) -> Line:
    data: Any = event.data
    if data.project_id is not None:
        return Line("project_session_created", "projects")
    return Line("session_created", "other")


def _named(name: str, resource: str = "other") -> Mapper:
    return lambda event: Line(name, resource)


SOURCES: dict[str, Mapper] = {
    training_events.SAVE_WEIGHTS["completed"]: _saved("checkpoint_saved"),
    training_events.SAVE_WEIGHTS_FOR_SAMPLER["completed"]: _saved("checkpoint_saved"),
    training_events.FORK["completed"]: _saved("checkpoint_saved"),
    training_events.SAVE_WEIGHTS_EXTERNAL["completed"]: _saved("checkpoint_exported"),
    checkpoint_events.CHECKPOINT_COPIED: _copied,
    checkpoint_events.CHECKPOINT_DELETED: _record("checkpoint_deleted"),
    checkpoint_events.CHECKPOINT_EXPIRED: _record("checkpoint_expired"),
    checkpoint_events.CHECKPOINT_PUBLISHED: _record("checkpoint_published"),
    checkpoint_events.CHECKPOINT_UNPUBLISHED: _record("checkpoint_unpublished"),
    checkpoint_events.CHECKPOINT_TTL_SET: _record("checkpoint_ttl_set"),
    training_events.LOAD_WEIGHTS["requested"]: _loaded,
    sampling_events.SAMPLING_SESSION_CREATED: _sampler,
    session_events.SESSION_PROJECT_ASSIGNED: _named("project_assigned", "projects"),
    session_events.SESSION_CREATED: _session_created,
    session_events.SESSION_FINISHED: _named("session_finished"),
    training_events.CREATE_MODEL["requested"]: _named("training_run_created"),
    training_events.FORK["requested"]: _named("training_run_forked"),
    training_events.RUN_CANCELLED: _named("training_run_cancelled"),
    access_events.LOOKUP_REFUSED: _named("access_refused"),
}
# The types whose every line is of one resource: what the store's query selects per filter.
# Sampling sessions and created sessions may be either, so they are read for both and
# filtered by their line.
_BY_RESOURCE = {
    "checkpoints": {
        *(t for t in SOURCES if t.split(".")[2] == "checkpoint"),
        training_events.SAVE_WEIGHTS["completed"],
        training_events.SAVE_WEIGHTS_FOR_SAMPLER["completed"],
        training_events.FORK["completed"],
        training_events.SAVE_WEIGHTS_EXTERNAL["completed"],
        training_events.LOAD_WEIGHTS["requested"],
        sampling_events.SAMPLING_SESSION_CREATED,
    },
    "projects": {session_events.SESSION_PROJECT_ASSIGNED, session_events.SESSION_CREATED},
}


def parse_event_type(value: Optional[str]) -> str:
    if value is None:
        return "all"
    if value not in EVENT_TYPES:
        raise InvalidRequest(f"event_type must be one of {', '.join(EVENT_TYPES)}; got {value[:60]!r}")
    return value


def parse_day(value: Optional[str], now: datetime) -> date:
    """The UTC day asked for: `YYYY-MM-DD` (the SDK sends `date.isoformat()`), today if absent."""
    if value is None:
        return now.astimezone(timezone.utc).date()
    try:
        if len(value) != 10:
            raise ValueError(value)
        return date.fromisoformat(value)
    except ValueError:
        raise InvalidRequest(f"day must be a date as YYYY-MM-DD; got {value[:60]!r}") from None


def day_window(day: date) -> tuple[datetime, datetime]:
    """Midnight to midnight UTC, end exclusive."""
    start = datetime.combine(day, time(0), tzinfo=timezone.utc)
    return start, start + timedelta(days=1)


def source_types(event_type: str) -> list[str]:
    """The stored event types that can give an entry under this filter (none for teams and
    organizations: nothing here is either)."""
    if event_type == "all":
        return sorted(SOURCES)
    return sorted(_BY_RESOURCE.get(event_type, ()))


def entry(event: Event, event_type: str) -> Optional[dict[str, Any]]:
    """The `AuditLogEntry` for one stored event under the filter, or None when it gives none."""
    mapper = SOURCES.get(event.type)
    line = mapper(event) if mapper is not None else None
    if line is None or (event_type != "all" and line.resource != event_type):
        return None
    out: dict[str, Any] = {
        "timestamp": event.time.astimezone(timezone.utc).isoformat(),
        "event": line.event,
        "event_details": entry_for(event),
    }
    if line.resource == "checkpoints":
        out["model_id"] = line.model_id
        out["tinker_path"] = line.tinker_path
        out["purpose"] = line.purpose
    return out
