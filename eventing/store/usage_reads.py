"""The store reads behind the AdminClient routes: usage by the hour, current storage, audit events.

Every read is scoped to one tenant and selects only the columns it needs, never a future's
result, a checkpoint's file list or an event's payload beyond the few audit types:

- `token_rows`: the tenant's completed training and sampling futures of a window, summed by
  the database per (UTC hour of completion, kind, model, session) through the index on
  (tenant, kind, completed_at), so a busy fortnight comes back as at most hours x models x
  sessions rows, not one per request. The hour is text in both dialects (SQLite stores
  datetimes as `YYYY-MM-DD HH:MM:SS…` UTC text; PostgreSQL formats it in UTC).
- `stored_rows`: the stored intervals that overlap the window, of live checkpoints
  (`checkpoints`) and removed ones (`removed_checkpoints`, by (tenant, removed_at)).
- `current_storage`: live checkpoints grouped by their run's session's current project.
- `audit_events`: the day's events of the given types, in time order, at most `limit` + 1
  rows, so the caller knows whether it cut the day.

Attribution (base model, session, project) is looked up per distinct run, sampling session
and session, in bounded IN lists; a session's project is its current one, so a reassigned
session's past usage moves with it, as the SDK documents.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Iterable, Optional

from sqlalchemy import ColumnElement, and_, func, or_, select
from sqlalchemy.engine import Connection, Engine

from eventing.store import tables as t
from eventing.store.event_store import EventStore
from eventing.store.unit_of_work import utc
from openrl_core.billing import StoredRow, TokenRow
from openrl_core.events import Event
from openrl_core.futures import FutureState

CHUNK = 500  # bounded IN lists: SQLite's default limit is 999 variables
DEFAULT_PROJECT = "default"  # what a session created without a project reports (as search_sessions does)
_KINDS = ("forward_backward", "sample")  # a forward is a forward_backward with forward_only set


def _hour_text(conn: Connection, column) -> ColumnElement:
    if conn.dialect.name == "postgresql":
        return func.to_char(func.timezone("UTC", column), "YYYY-MM-DD HH24")
    return func.substr(column, 1, 13)


def _lookup(conn: Connection, table, key, columns, tenant: str, ids: Iterable[str]) -> dict:
    wanted = sorted({i for i in ids if i is not None})
    out = {}
    for start in range(0, len(wanted), CHUNK):
        query = select(key, *columns).where(table.c.tenant == tenant, key.in_(wanted[start : start + CHUNK]))
        out.update({row[0]: tuple(row[1:]) for row in conn.execute(query)})
    return out


def _projects(conn: Connection, tenant: str, session_ids: Iterable[Optional[str]]) -> dict[str, str]:
    s = t.sessions.c
    found = _lookup(conn, t.sessions, s.session_id, [s.project_id], tenant, [i for i in session_ids if i])
    return {session: project or DEFAULT_PROJECT for session, (project,) in found.items()}


def usage(engine: Engine, tenant: str, start: datetime, end: datetime) -> tuple[list, list, dict]:
    """`token_rows`, `stored_rows` and `session_metadata` of their sessions, read over one
    connection (the billing route's one read: one pooled connection, not three)."""
    with engine.connect() as conn:
        tokens, stored = _token_rows(conn, tenant, start, end), _stored_rows(conn, tenant, start, end)
        sessions = _session_metadata(conn, tenant, {r.session_id for r in [*tokens, *stored] if r.session_id})
    return tokens, stored, sessions


def token_rows(engine: Engine, tenant: str, start: datetime, end: datetime) -> list[TokenRow]:
    with engine.connect() as conn:
        return _token_rows(conn, tenant, start, end)


def stored_rows(engine: Engine, tenant: str, start: datetime, end: datetime) -> list[StoredRow]:
    with engine.connect() as conn:
        return _stored_rows(conn, tenant, start, end)


def session_metadata(engine: Engine, tenant: str, session_ids: Iterable[str]) -> dict[str, Optional[dict]]:
    with engine.connect() as conn:
        return _session_metadata(conn, tenant, session_ids)


def _token_rows(conn: Connection, tenant: str, start: datetime, end: datetime) -> list[TokenRow]:
    f = t.futures.c
    hour = _hour_text(conn, f.completed_at).label("hour")
    query = (
        select(
            hour,
            f.kind,
            f.model_id,
            f.session_id,
            func.coalesce(func.sum(f.tokens), 0),
            func.coalesce(func.sum(f.prefill_tokens), 0),
            func.coalesce(func.sum(f.sampled_tokens), 0),
        )
        .where(
            f.tenant == tenant,
            f.completed_at >= start,
            f.completed_at < end,
            f.state == FutureState.COMPLETED.value,
            f.kind.in_(_KINDS),
        )
        .group_by(hour, f.kind, f.model_id, f.session_id)
    )
    sums = conn.execute(query).all()
    runs = _lookup(conn, t.training_runs, t.training_runs.c.model_id, [t.training_runs.c.base_model], tenant,
                   (r.model_id for r in sums if r.kind == "forward_backward"))  # fmt: skip
    samplers = _lookup(conn, t.sampling_sessions, t.sampling_sessions.c.sampling_session_id,
                       [t.sampling_sessions.c.base_model], tenant, (r.model_id for r in sums if r.kind == "sample"))  # fmt: skip
    projects = _projects(conn, tenant, (r.session_id for r in sums))
    out = []
    for text, kind, model_id, session_id, training, prefill, sampled in sums:
        at = datetime.strptime(str(text)[:13].replace("T", " "), "%Y-%m-%d %H").replace(tzinfo=timezone.utc)
        models = runs if kind == "forward_backward" else samplers
        base_model = models.get(model_id, (None,))[0]
        who = dict(base_model=base_model, session_id=session_id, project_id=projects.get(session_id or ""))
        if kind == "forward_backward":
            out.append(TokenRow(at, "training", int(training), **who))
        else:
            out.append(TokenRow(at, "sampling_prefill", int(prefill), **who))
            out.append(TokenRow(at, "sampling_sample", int(sampled), **who))
    return out


def _stored_rows(conn: Connection, tenant: str, start: datetime, end: datetime) -> list[StoredRow]:
    c, r = t.checkpoints.c, t.removed_checkpoints.c
    live = conn.execute(
        select(c.run_id, c.created_at, c.expires_at, c.size_bytes).where(
            c.tenant == tenant, c.created_at < end, or_(c.expires_at.is_(None), c.expires_at > start)
        )
    ).all()
    gone = conn.execute(
        select(r.run_id, r.saved_at, r.removed_at, r.size_bytes).where(
            r.tenant == tenant, r.removed_at >= start, r.saved_at < end
        )
    ).all()
    tr = t.training_runs.c
    runs = _lookup(conn, t.training_runs, tr.model_id, [tr.base_model, tr.session_id], tenant,
                   (row.run_id for row in [*live, *gone]))  # fmt: skip
    projects = _projects(conn, tenant, (session for _base, session in runs.values()))
    out = []
    intervals = [(run, saved, expires, None, size) for run, saved, expires, size in live]
    intervals += [(run, saved, None, removed, size) for run, saved, removed, size in gone]
    for run_id, saved, expires, removed, size in intervals:
        base_model, session_id = runs.get(run_id, (None, None))
        out.append(
            StoredRow(
                saved_at=utc(saved),
                removed_at=utc(removed),
                expires_at=utc(expires),
                size_bytes=int(size),
                base_model=base_model,
                session_id=session_id,
                project_id=projects.get(session_id or ""),
            )
        )
    return out


def _session_metadata(conn: Connection, tenant: str, session_ids: Iterable[str]) -> dict[str, Optional[dict]]:
    s = t.sessions.c
    found = _lookup(conn, t.sessions, s.session_id, [s.user_metadata], tenant, session_ids)
    return {session: ({str(k): str(v) for k, v in meta.items()} or None) for session, (meta,) in found.items()}


def current_storage(engine: Engine, tenant: str, now: datetime, project_id: Optional[str]) -> list[tuple]:
    """(project_id, checkpoint count, bytes) per project, of the tenant's live checkpoints."""
    c, r, s = t.checkpoints.c, t.training_runs.c, t.sessions.c
    project = func.coalesce(s.project_id, DEFAULT_PROJECT)
    query = (
        select(project, func.count(), func.coalesce(func.sum(c.size_bytes), 0))
        .select_from(
            t.checkpoints.outerjoin(t.training_runs, and_(r.model_id == c.run_id, r.tenant == tenant)).outerjoin(
                t.sessions, and_(s.session_id == r.session_id, s.tenant == tenant)
            )
        )
        .where(c.tenant == tenant, or_(c.expires_at.is_(None), c.expires_at > now))
        .group_by(project)
        .order_by(project)
    )
    if project_id is not None:
        query = query.where(project == project_id)
    with engine.connect() as conn:
        return [(str(p), int(count), int(size)) for p, count, size in conn.execute(query)]


def audit_events(
    store: EventStore, tenant: str, types: list[str], start: datetime, end: datetime, limit: int
) -> tuple[list[Event], bool]:
    """The tenant's events of `types` in [start, end), oldest first: at most `limit`, and
    whether more were there."""
    if not types:
        return [], False
    e = t.events.c
    query = (
        select(t.events)
        .where(e.tenant == tenant, e.type.in_(types), e.time >= start, e.time < end)
        .order_by(e.time, e.position)
        .limit(limit + 1)
    )
    with store.engine.connect() as conn:
        rows = conn.execute(query).all()
    return [store.event_of(row) for row in rows[:limit]], len(rows) > limit
