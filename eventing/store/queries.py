"""Reads of the projections, always scoped to one tenant.

Every lookup takes the tenant and filters on it, so another tenant's object is simply not
found: the caller answers 404 exactly as for an id that never existed.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Optional

from sqlalchemy import func, insert, or_, select
from sqlalchemy.engine import Engine, Row

from eventing.store import tables as t
from eventing.store.driver_reads import LazyRow, read_by_key
from eventing.store.kept import kept
from eventing.store.projections import utc
from eventing.store.row_tables import primary_key
from openrl_core.retention import SamplerVersion, live_sampler_versions


def _live(now: datetime):
    """A checkpoint past its expires_at is hidden at once, before the reaper removes it."""
    return or_(t.checkpoints.c.expires_at.is_(None), t.checkpoints.c.expires_at > now)


def _page(engine: Engine, query, limit: Optional[int], offset: int) -> tuple[list[Row], int]:
    """One page of `query` and the total count of its rows."""
    with engine.connect() as conn:
        total = conn.execute(select(func.count()).select_from(query.order_by(None).subquery())).scalar() or 0
        if limit is not None:
            query = query.limit(limit)
        rows = list(conn.execute(query.offset(offset)))
    return rows, int(total)


class Projections:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._kept = kept(engine)

    def _one(self, table, tenant: str, **keys) -> Optional[LazyRow]:
        """The row of `table` with primary key `keys` if `tenant` owns it. In driver SQL
        (`driver_reads.read_by_key`): every request looks up its run, session or future, and
        through SQLAlchemy Core the lookup cost several times the driver's query."""
        key = tuple(keys[name] for name in primary_key(table.name))
        with self._kept.connect() as conn:  # on a SQLite file, the thread's kept connection (kept.py)
            row = read_by_key(conn, table.name, key)
        return row if row is not None and row.tenant == tenant else None

    def future(self, tenant: str, request_id: str) -> Optional[LazyRow]:
        return self._one(t.futures, tenant, request_id=request_id)

    def session(self, tenant: str, session_id: str) -> Optional[LazyRow]:
        return self._one(t.sessions, tenant, session_id=session_id)

    def run(self, tenant: str, model_id: str) -> Optional[LazyRow]:
        return self._one(t.training_runs, tenant, model_id=model_id)

    def checkpoint(self, tenant: str, run_id: str, checkpoint_id: str) -> Optional[LazyRow]:
        return self._one(t.checkpoints, tenant, run_id=run_id, checkpoint_id=checkpoint_id)

    def sampling_session(self, tenant: str, sampling_session_id: str) -> Optional[LazyRow]:
        return self._one(t.sampling_sessions, tenant, sampling_session_id=sampling_session_id)

    def runs_of_session(self, tenant: str, session_id: str) -> list[Row]:
        query = select(t.training_runs).where(
            t.training_runs.c.tenant == tenant, t.training_runs.c.session_id == session_id
        )
        with self.engine.connect() as conn:
            return list(conn.execute(query))

    def table_rows(self, table_name: str) -> list[dict[str, Any]]:
        """Every row of one projection, for replay's diff."""
        table = t.metadata.tables[table_name]
        with self.engine.connect() as conn:
            rows = conn.execute(select(table).order_by(*table.primary_key.columns)).mappings().all()
        return [{k: (utc(v) if isinstance(v, datetime) else v) for k, v in row.items()} for row in rows]

    # -- API keys ----------------------------------------------------------------------------

    def register_keys(self, key_hashes: dict[str, str]) -> None:
        """Store configured keys (their SHA-256 only) so the store knows every tenant."""
        with self.engine.begin() as conn:
            known = {row.key_sha256 for row in conn.execute(select(t.api_keys.c.key_sha256))}
            fresh = [
                {"key_sha256": digest, "tenant": tenant, "created_at": datetime.now(timezone.utc)}
                for digest, tenant in key_hashes.items()
                if digest not in known
            ]
            if fresh:
                conn.execute(insert(t.api_keys), fresh)

    def tenant_for_key_hash(self, key_sha256: str) -> Optional[str]:
        with self.engine.connect() as conn:
            return conn.execute(select(t.api_keys.c.tenant).where(t.api_keys.c.key_sha256 == key_sha256)).scalar()

    # -- REST reads: runs, checkpoints and sessions, paged, newest first ---------------------

    def live_checkpoint(self, tenant: str, run_id: str, checkpoint_id: str, now: datetime) -> Optional[Row]:
        query = select(t.checkpoints).where(
            t.checkpoints.c.tenant == tenant,
            t.checkpoints.c.run_id == run_id,
            t.checkpoints.c.checkpoint_id == checkpoint_id,
            _live(now),
        )
        with self.engine.connect() as conn:
            return conn.execute(query).first()

    def live_checkpoints(
        self,
        tenant: str,
        now: datetime,
        *,
        run_id: Optional[str] = None,
        kind: Optional[str] = None,
        limit: Optional[int] = None,
        offset: int = 0,
    ) -> tuple[list[Row], int]:
        query = select(t.checkpoints).where(t.checkpoints.c.tenant == tenant, _live(now))
        if run_id is not None:
            query = query.where(t.checkpoints.c.run_id == run_id)
        if kind is not None:
            query = query.where(t.checkpoints.c.kind == kind)
        query = query.order_by(t.checkpoints.c.created_at.desc(), t.checkpoints.c.run_id, t.checkpoints.c.checkpoint_id)
        return _page(self.engine, query, limit, offset)

    def runs_page(
        self, tenant: str, limit: int, offset: int, project_id: Optional[str] = None
    ) -> tuple[list[Row], int]:
        query = select(t.training_runs).where(t.training_runs.c.tenant == tenant)
        if project_id is not None:
            in_project = select(t.sessions.c.session_id).where(
                t.sessions.c.tenant == tenant, t.sessions.c.project_id == project_id
            )
            query = query.where(t.training_runs.c.session_id.in_(in_project))
        query = query.order_by(t.training_runs.c.created_at.desc(), t.training_runs.c.model_id)
        return _page(self.engine, query, limit, offset)

    def sessions_page(self, tenant: str, limit: int, offset: int) -> tuple[list[Row], int]:
        query = select(t.sessions).where(t.sessions.c.tenant == tenant)
        return _page(
            self.engine, query.order_by(t.sessions.c.created_at.desc(), t.sessions.c.session_id), limit, offset
        )

    def sampling_sessions_of(self, tenant: str, session_id: str) -> list[Row]:
        query = (
            select(t.sampling_sessions)
            .where(t.sampling_sessions.c.tenant == tenant, t.sampling_sessions.c.session_id == session_id)
            .order_by(t.sampling_sessions.c.created_at, t.sampling_sessions.c.sampling_session_id)
        )
        with self.engine.connect() as conn:
            return list(conn.execute(query))

    def expired_checkpoints(self, now: datetime, limit: int = 500) -> list[Row]:
        """Every tenant's checkpoints whose expiry has passed, oldest expiry first."""
        query = (
            select(t.checkpoints)
            .where(t.checkpoints.c.expires_at.is_not(None), t.checkpoints.c.expires_at <= now)
            .order_by(t.checkpoints.c.expires_at, t.checkpoints.c.run_id, t.checkpoints.c.checkpoint_id)
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return list(conn.execute(query))

    def checkpoint_blobs(self, tenant: str) -> set[str]:
        """Hashes of every checkpoint record's files (expired or not: the reaper removes those)."""
        digests: set[str] = set()
        with self.engine.connect() as conn:
            for (files,) in conn.execute(select(t.checkpoints.c.files).where(t.checkpoints.c.tenant == tenant)):
                digests.update(ref["sha256"] for ref in (files or {}).values())
        return digests

    def sampler_versions(self, tenant: str) -> list[Row]:
        """Every sampling session of a tenant with its weights and whether its client session
        finished (`session_finished_at`): what the blob collector's retention rules read."""
        sessions, samplers = t.sessions, t.sampling_sessions
        query = (
            select(samplers, sessions.c.finished_at.label("session_finished_at"))
            .select_from(samplers.outerjoin(sessions, sessions.c.session_id == samplers.c.session_id))
            .where(samplers.c.tenant == tenant)
        )
        with self.engine.connect() as conn:
            return list(conn.execute(query))

    def live_samplers(self, tenant: str, keep_per_run: int) -> list[Row]:
        """The sampling sessions whose weights stay (`openrl_core.retention.live_sampler_versions`)."""
        rows = self.sampler_versions(tenant)
        versions = [
            SamplerVersion(
                sampling_session_id=row.sampling_session_id,
                run_id=row.run_id,
                created_at=row.created_at,
                from_checkpoint=row.model_path is not None,
                session_finished=row.session_finished_at is not None,
                closed=row.closed_at is not None,
            )
            for row in rows
        ]
        live = live_sampler_versions(versions, keep_per_run)
        return [row for row in rows if row.sampling_session_id in live]

    def event_claims(self, tenant: str) -> set[str]:
        """Hashes of the payloads stored events hold by reference (claim checks)."""
        query = (
            select(t.events.c.claim_sha256)
            .where(t.events.c.tenant == tenant, t.events.c.claim_sha256.is_not(None))
            .distinct()
        )
        with self.engine.connect() as conn:
            return {digest for (digest,) in conn.execute(query)}

    def referenced_blobs(self, tenant: str) -> set[str]:
        """Hashes that a checkpoint record (expired or not) or a sampling session points at.

        Sampling sessions count: one made from a checkpoint keeps sampling after the
        checkpoint is deleted, and an ephemeral one's adapter can be byte-identical to a
        saved checkpoint's.
        """
        digests: set[str] = set()
        with self.engine.connect() as conn:
            for (files,) in conn.execute(select(t.checkpoints.c.files).where(t.checkpoints.c.tenant == tenant)):
                digests.update(ref["sha256"] for ref in (files or {}).values())
            adapters = select(t.sampling_sessions.c.adapter).where(t.sampling_sessions.c.tenant == tenant)
            for (adapter,) in conn.execute(adapters):
                digests.update(ref["sha256"] for ref in (adapter or {}).values())
        return digests
