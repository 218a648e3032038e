"""Reads of the projections for the OpenRL API (`/api/openrl/v1`, the `openrl runs` CLI).

Like `queries.Projections`, every read is scoped to a tenant, except that the tenant may be
None: the operator's view, every tenant at once. A run's status is derived here, in one
place: `cancelled`, `failed` (its creation failed), `creating`, `frozen` (a copy made by
copy_weights, never trained), `finished` (its session finished) or `active`.

A run's events (`run_events`) are those keyed by the run or by one of its sampling sessions,
in store order: the run's own training requests and completions, its checkpoints, its
cancellation, and its samples. They are read as rows, payload undecoded, so a reader decides
what to decode (the dashboard's live stream never loads a claim-checked payload).
"""

from __future__ import annotations

from datetime import datetime
from typing import Optional

from sqlalchemy import ColumnElement, func, or_, select, true
from sqlalchemy.engine import Engine, Row

from eventing.store import tables as t


def run_status(state: str, session_finished_at: Optional[datetime]) -> str:
    if state == "ready":
        return "finished" if session_finished_at is not None else "active"
    return state  # cancelled, failed, creating, frozen


def _mine(table, tenant: Optional[str]) -> ColumnElement[bool]:
    return table.c.tenant == tenant if tenant is not None else true()  # what `where(True)` makes of True


class RunViews:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def _runs_query(self, tenant: Optional[str]):
        # Counted per run, through run_steps' primary key: as a grouped subquery joined to the
        # runs, every tenant's every step was counted for each read, one run's included.
        steps = (
            select(func.count())
            .where(t.run_steps.c.model_id == t.training_runs.c.model_id, t.run_steps.c.completed_at.is_not(None))
            .correlate(t.training_runs)
            .scalar_subquery()
        )
        return (
            select(t.training_runs, steps.label("steps"), t.sessions.c.finished_at.label("session_finished_at"))
            .outerjoin(t.sessions, t.sessions.c.session_id == t.training_runs.c.session_id)
            .where(_mine(t.training_runs, tenant))
        )

    def runs(
        self, tenant: Optional[str], limit: int, offset: int, status: Optional[str] = None
    ) -> tuple[list[Row], int]:
        """Newest first; `status` filters on the derived status."""
        query = self._runs_query(tenant).order_by(t.training_runs.c.created_at.desc(), t.training_runs.c.model_id)
        with self.engine.connect() as conn:
            rows = [row for row in conn.execute(query) if status is None or self.status(row) == status]
        return rows[offset : offset + limit], len(rows)

    def run(self, tenant: Optional[str], run_id: str) -> Optional[Row]:
        query = self._runs_query(tenant).where(t.training_runs.c.model_id == run_id)
        with self.engine.connect() as conn:
            return conn.execute(query).first()

    @staticmethod
    def status(row: Row) -> str:
        return run_status(row.state, row.session_finished_at)

    def steps(self, run_id: str, after: int = 0) -> list[Row]:
        """The run's completed steps in order (the run was already checked to be the caller's)."""
        query = (
            select(t.run_steps)
            .where(
                t.run_steps.c.model_id == run_id, t.run_steps.c.completed_at.is_not(None), t.run_steps.c.step > after
            )
            .order_by(t.run_steps.c.step)
        )
        with self.engine.connect() as conn:
            return list(conn.execute(query))

    def fork_request(self, tenant: str, fork_id: str) -> Optional[str]:
        """The request id of the fork event that made `fork_id`."""
        query = select(t.futures.c.request_id).where(
            t.futures.c.tenant == tenant, t.futures.c.model_id == fork_id, t.futures.c.kind == "fork"
        )
        with self.engine.connect() as conn:
            return conn.execute(query).scalar()

    def open_futures(self, tenant: str, keys: list[str]) -> list[str]:
        query = select(t.futures.c.request_id).where(
            t.futures.c.tenant == tenant, t.futures.c.model_id.in_(keys), t.futures.c.state.in_(("pending", "running"))
        )
        with self.engine.connect() as conn:
            return [row.request_id for row in conn.execute(query)]

    def cancelled_futures(self, tenant: str, keys: list[str]) -> list[str]:
        query = select(t.futures.c.request_id).where(
            t.futures.c.tenant == tenant, t.futures.c.model_id.in_(keys), t.futures.c.state == "cancelled"
        )
        with self.engine.connect() as conn:
            return [row.request_id for row in conn.execute(query)]

    def sampling_sessions_of_run(self, tenant: str, run_id: str) -> list[Row]:
        query = (
            select(t.sampling_sessions)
            .where(t.sampling_sessions.c.tenant == tenant, t.sampling_sessions.c.run_id == run_id)
            .order_by(t.sampling_sessions.c.created_at, t.sampling_sessions.c.sampling_session_id)
        )
        with self.engine.connect() as conn:
            return list(conn.execute(query))

    def checkpoints(self, tenant: Optional[str], now: datetime, run_id: Optional[str] = None) -> list[Row]:
        """Live checkpoints, newest first."""
        query = select(t.checkpoints).where(
            _mine(t.checkpoints, tenant), or_(t.checkpoints.c.expires_at.is_(None), t.checkpoints.c.expires_at > now)
        )
        if run_id is not None:
            query = query.where(t.checkpoints.c.run_id == run_id)
        query = query.order_by(t.checkpoints.c.created_at.desc(), t.checkpoints.c.run_id, t.checkpoints.c.checkpoint_id)
        with self.engine.connect() as conn:
            return list(conn.execute(query))

    def run_events(self, tenant: str, keys: list[str], after: int, limit: int, newest: bool = False) -> list[Row]:
        """Events of `tenant` keyed by one of `keys` past store position `after`, oldest first:
        the first `limit` of them, or with `newest` the last `limit`."""
        e = t.events
        query = select(e.c.position, e.c.id, e.c.type, e.c.key, e.c.subject, e.c.time, e.c.data, e.c.claim_size).where(
            e.c.tenant == tenant, e.c.key.in_(keys), e.c.position > after
        )
        query = query.order_by(e.c.position.desc() if newest else e.c.position).limit(limit)
        with self.engine.connect() as conn:
            rows = list(conn.execute(query))
        return rows[::-1] if newest else rows

    def finished_samples(self, tenant: str, sampling_session_ids: list[str], limit: int) -> list[Row]:
        """The latest `limit` completed sample requests of these sampling sessions, oldest first."""
        f = t.futures
        query = (
            select(f.c.request_id, f.c.model_id, f.c.created_at, f.c.completed_at, f.c.result)
            .where(
                f.c.tenant == tenant,
                f.c.kind == "sample",
                f.c.state == "completed",
                f.c.model_id.in_(sampling_session_ids),
            )
            .order_by(f.c.completed_at.desc(), f.c.request_id)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return list(conn.execute(query))[::-1]

    def tenants_of_runs(self, run_ids: list[str]) -> dict[str, str]:
        """run id -> its tenant, for those of `run_ids` that exist."""
        query = select(t.training_runs.c.model_id, t.training_runs.c.tenant).where(
            t.training_runs.c.model_id.in_(run_ids)
        )
        with self.engine.connect() as conn:
            return {row.model_id: row.tenant for row in conn.execute(query)}

    def sessions(
        self, tenant: Optional[str], limit: int, offset: int
    ) -> tuple[list[Row], int, dict[str, int], dict[str, int]]:
        """Sessions newest first, with how many training runs and sampling sessions each holds."""
        query = (
            select(t.sessions)
            .where(_mine(t.sessions, tenant))
            .order_by(t.sessions.c.created_at.desc(), t.sessions.c.session_id)
        )
        with self.engine.connect() as conn:
            total = int(conn.execute(select(func.count()).where(_mine(t.sessions, tenant))).scalar() or 0)
            rows = list(conn.execute(query.limit(limit).offset(offset)))
            ids = [row.session_id for row in rows]
            runs = dict(
                conn.execute(
                    select(t.training_runs.c.session_id, func.count())
                    .where(t.training_runs.c.session_id.in_(ids))
                    .group_by(t.training_runs.c.session_id)
                ).all()
            )
            samplers = dict(
                conn.execute(
                    select(t.sampling_sessions.c.session_id, func.count())
                    .where(t.sampling_sessions.c.session_id.in_(ids))
                    .group_by(t.sampling_sessions.c.session_id)
                ).all()
            )
        return rows, total, runs, samplers
