"""What the runs are doing, read from the projections for the scheduler: one `Activity` per run or sampling session.

A row comes from every training run and sampling session whose session is unfinished or
that still has unfinished futures (a finished session's requests in flight still need a
worker). Its `last_request` is the newest of its futures (or its creation time), `pending`
counts its futures not yet terminal, `oldest_pending` is when the oldest of them was made.
A full fine-tuning run is a training run with `is_lora = false`. A cancelled run and the
sampling sessions its cancellation closed make no row: they need no worker.

The futures are read through their (tenant, session_id) index, only for the sessions that
can matter, so a store with years of finished sessions costs no full scan per reconcile.
`requests_of` reads back the stored `…requested` events of futures, which the scheduler
needs to fail them with the right event type.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Iterable, Optional, overload

from sqlalchemy import and_, func, or_, select
from sqlalchemy.engine import Engine

from eventing.store import tables as t
from eventing.store.event_store import EventStore
from openrl_core.events import Event
from openrl_core.futures import FutureState
from openrl_core.workload import Activity, ActivityKind

OPEN = (FutureState.PENDING.value, FutureState.RUNNING.value)


@overload
def _utc(moment: datetime) -> datetime: ...
@overload
def _utc(moment: None) -> None: ...
@overload
def _utc(moment: Optional[datetime]) -> Optional[datetime]: ...


def _utc(moment: Optional[datetime]) -> Optional[datetime]:
    if moment is None:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def read_activity(engine: Engine) -> list[Activity]:
    with engine.connect() as conn:
        # Sessions that can matter: unfinished ones, and finished ones with futures in flight.
        in_flight = select(t.futures.c.tenant, t.futures.c.session_id).where(t.futures.c.state.in_(OPEN)).distinct()
        flying = {(row.tenant, row.session_id) for row in conn.execute(in_flight)}
        sessions = {
            (row.tenant, row.session_id): row.finished_at is not None
            for row in conn.execute(select(t.sessions.c.tenant, t.sessions.c.session_id, t.sessions.c.finished_at))
            if row.finished_at is None or (row.tenant, row.session_id) in flying
        }
        if not sessions:
            return []
        keys = list(sessions)
        by_session = or_(*[and_(t.futures.c.tenant == tenant, t.futures.c.session_id == sid) for tenant, sid in keys])
        stats = (
            select(
                t.futures.c.tenant,
                t.futures.c.model_id,
                func.max(t.futures.c.created_at).label("newest"),
                func.count().filter(t.futures.c.state.in_(OPEN)).label("pending"),
                func.min(t.futures.c.created_at).filter(t.futures.c.state.in_(OPEN)).label("oldest_pending"),
            )
            .where(by_session)
            .group_by(t.futures.c.tenant, t.futures.c.model_id)
        )
        futures = {(row.tenant, row.model_id): row for row in conn.execute(stats)}
        runs = conn.execute(select(t.training_runs)).all()
        samplers = conn.execute(select(t.sampling_sessions)).all()
    activities: list[Activity] = []
    candidates: list[tuple[Any, str, ActivityKind]] = [
        *[(r, r.model_id, "lora" if r.is_lora else "full") for r in runs],
        *[(s, s.sampling_session_id, "sampling") for s in samplers],
    ]
    for row, key, kind in candidates:
        finished = sessions.get((row.tenant, row.session_id))
        if finished is None or _ended(row, kind):
            continue
        stat = futures.get((row.tenant, key))
        newest = _utc(stat.newest) if stat is not None else None
        created = _utc(row.created_at)
        activities.append(
            Activity(
                tenant=row.tenant,
                key=key,
                kind=kind,
                base_model=row.base_model,
                session_finished=finished,
                last_request=max(newest, created) if newest else created,
                pending=int(stat.pending) if stat is not None else 0,
                oldest_pending=_utc(stat.oldest_pending) if stat is not None else None,
            )
        )
    return activities


def _ended(row, kind: str) -> bool:
    """A cancelled run, or a sampling session its cancellation closed, needs no worker."""
    if kind == "sampling":
        return getattr(row, "closed_at", None) is not None
    return row.state == "cancelled"


def pending_request_ids(engine: Engine, tenant: str, key: str) -> list[str]:
    query = select(t.futures.c.request_id).where(
        t.futures.c.tenant == tenant, t.futures.c.model_id == key, t.futures.c.state.in_(OPEN)
    )
    with engine.connect() as conn:
        return sorted(row.request_id for row in conn.execute(query))


def requests_of(store: EventStore, tenant: str, key: str, request_ids: Iterable[str]) -> list[Event]:
    """The stored `…requested` events of these futures (the gateway sets subject = request id)."""
    wanted = set(request_ids)
    if not wanted:
        return []
    query = select(t.events).where(t.events.c.tenant == tenant, t.events.c.key == key, t.events.c.subject.in_(wanted))
    with store.engine.connect() as conn:
        rows = conn.execute(query.order_by(t.events.c.position)).all()
    # The store's own row decoder, so claim-checked payloads come back exactly as stored.
    events = [store._row_to_event(row) for row in rows]
    return [e for e in events if e.phase == "requested" and getattr(e.data, "request_id", None) in wanted]
