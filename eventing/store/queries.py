"""Reads of the projections, always scoped to one tenant.

Every lookup takes the tenant and filters on it, so another tenant's object is simply not
found: the caller answers 404 exactly as for an id that never existed.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Optional

from sqlalchemy import insert, select
from sqlalchemy.engine import Engine, Row

from eventing.store import tables as t
from eventing.store.projections import utc


class Projections:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def _one(self, table, tenant: str, **keys) -> Optional[Row]:
        query = select(table).where(table.c.tenant == tenant, *(table.c[name] == value for name, value in keys.items()))
        with self.engine.connect() as conn:
            return conn.execute(query).first()

    def future(self, tenant: str, request_id: str) -> Optional[Row]:
        return self._one(t.futures, tenant, request_id=request_id)

    def session(self, tenant: str, session_id: str) -> Optional[Row]:
        return self._one(t.sessions, tenant, session_id=session_id)

    def run(self, tenant: str, model_id: str) -> Optional[Row]:
        return self._one(t.training_runs, tenant, model_id=model_id)

    def checkpoint(self, tenant: str, run_id: str, checkpoint_id: str) -> Optional[Row]:
        return self._one(t.checkpoints, tenant, run_id=run_id, checkpoint_id=checkpoint_id)

    def sampling_session(self, tenant: str, sampling_session_id: str) -> Optional[Row]:
        return self._one(t.sampling_sessions, tenant, sampling_session_id=sampling_session_id)

    def runs_of_session(self, tenant: str, session_id: str) -> list[Row]:
        query = select(t.training_runs).where(t.training_runs.c.tenant == tenant, t.training_runs.c.session_id == session_id)
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
