"""The stored events of one session, for its trace: envelopes only, never payloads.

A session's requests are the events keyed by its training runs (a run's model id keys its
training events) and by its sampling sessions (a sampling session id keys its samples),
plus the session's own events. The trace needs only when each phase of each request
happened, which worker answered it and under which timeslicer lease, and all of that is in
the events table's envelope columns (type, source, key, subject = request id, time,
lease_id), except when work began: the trainer records that in its completion's
`details.started` (it emits no `…started` event), so completions, and only they, are decoded.
A fenced event (refused because a
later lease had already applied its key) is still returned, marked, because a trace should
show the work a fenced holder did. Always scoped to one tenant.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Optional

from sqlalchemy import select
from sqlalchemy.engine import Engine

from eventing.store import tables as t
from eventing.store.event_store import EventStore
from eventing.store.projections import utc

# Bounded IN lists: PostgreSQL takes many more, SQLite's default limit is 999 variables.
CHUNK = 500


@dataclass(frozen=True)
class StoredEnvelope:
    position: int
    type: str
    source: str
    key: Optional[str]
    subject: Optional[str]
    time: datetime
    lease_id: Optional[int]
    fenced: bool
    # From a completion's details: when the worker began the work.
    started: Optional[datetime] = None


@dataclass(frozen=True)
class SessionKeys:
    """The keys under which a session's events are stored, with what each key names."""

    runs: dict[str, str]  # training run (model id) -> base model
    samplers: dict[str, str]  # sampling session id -> base model

    def all(self) -> list[str]:
        return sorted(self.runs) + sorted(self.samplers)


def _started_of(store: EventStore, row) -> Optional[datetime]:
    details = getattr(store.event_of(row).data, "details", None) or {}
    try:
        return utc(datetime.fromisoformat(details["started"])) if "started" in details else None
    except (TypeError, ValueError):
        return None


class SessionTrace:
    def __init__(self, store: EventStore) -> None:
        self.store = store
        self.engine: Engine = store.engine

    def keys(self, tenant: str, session_id: str) -> SessionKeys:
        runs, samplers = t.training_runs.c, t.sampling_sessions.c
        with self.engine.connect() as conn:
            run_rows = conn.execute(
                select(runs.model_id, runs.base_model).where(runs.tenant == tenant, runs.session_id == session_id)
            )
            sampler_rows = conn.execute(
                select(samplers.sampling_session_id, samplers.base_model).where(
                    samplers.tenant == tenant, samplers.session_id == session_id
                )
            )
            return SessionKeys(dict(run_rows.all()), dict(sampler_rows.all()))

    def envelopes(self, tenant: str, session_id: str, keys: SessionKeys) -> list[StoredEnvelope]:
        """Every stored event of the session and of its runs and samplers, in store order."""
        e = t.events.c
        wanted = [session_id, *keys.all()]
        out: list[StoredEnvelope] = []
        with self.engine.connect() as conn:
            for start in range(0, len(wanted), CHUNK):
                chunk = wanted[start : start + CHUNK]
                query = select(t.events).where(e.tenant == tenant, e.key.in_(chunk))
                out.extend(self._envelope(row) for row in conn.execute(query))
        out.sort(key=lambda envelope: envelope.position)
        return out

    def request_envelopes(self, tenant: str, requests: dict[str, set[str]]) -> list[StoredEnvelope]:
        """The stored events of the given requests (key -> request ids), in store order: what
        one request's OpenTelemetry trace is built from (functions/request_traces.py). Read by
        key (indexed) and subject, so a request's events keyed elsewhere are not found."""
        e = t.events.c
        out: list[StoredEnvelope] = []
        with self.engine.connect() as conn:
            for key, subjects in requests.items():
                wanted = sorted(subjects)
                for start in range(0, len(wanted), CHUNK):
                    query = select(t.events).where(
                        e.tenant == tenant, e.key == key, e.subject.in_(wanted[start : start + CHUNK])
                    )
                    out.extend(self._envelope(row) for row in conn.execute(query))
        out.sort(key=lambda envelope: envelope.position)
        return out

    def _envelope(self, row) -> StoredEnvelope:
        completed = row.type.rsplit(".", 2)[-2] == "completed" and row.subject is not None
        return StoredEnvelope(
            position=int(row.position),
            type=row.type,
            source=row.source,
            key=row.key,
            subject=row.subject,
            time=utc(row.time),
            lease_id=row.lease_id,
            fenced=bool(row.fenced),
            started=_started_of(self.store, row) if completed else None,
        )
