"""Session search: one tenant's sessions filtered and paged newest first, with their counts.

What `RestClient.search_sessions` (SDK 0.38) reads. Every query is scoped to the tenant, so
another tenant's session never matches. Pages are keyset pages over (created_at DESC,
session_id ASC), the order `sessions_page` lists in: a cursor names the last row of the
previous page, and a page never repeats or skips a session that existed when the first page
was read, however many are created meanwhile (a new session sorts before the cursor).

Matching follows the SDK's field docs: `session_id` and `display_name` are alternatives (a
session matching either matches); `display_name` is case-insensitive and every word of it
must occur in the name; `user_metadata` pairs must all hold exactly; `project_ids` names
projects, where `DEFAULT_PROJECT` stands for a session created without one. Text filters
run in Python over the tenant's candidate rows (a tenant's sessions are few, and SQLite and
PostgreSQL disagree on case folding and JSON operators); the order and the page are SQL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Optional

from sqlalchemy import and_, func, or_, select
from sqlalchemy.engine import Engine, Row

from eventing.store import tables as t

# What a session created without a project reports as its project (SessionSummary.project_id
# is a required string in the SDK).
DEFAULT_PROJECT = "default"


@dataclass(frozen=True)
class SessionFilter:
    session_id: Optional[str] = None
    display_name: Optional[str] = None
    project_ids: Optional[list[str]] = None
    user_metadata: dict[str, str] = field(default_factory=dict)
    # States to match: "active", "finished:<reason>" (the reason the client gave) or
    # "finished:*" (any reason); None matches every session.
    states: Optional[set[str]] = None


@dataclass(frozen=True)
class SessionHit:
    row: Row
    checkpoints_count: int
    checkpoint_storage_bytes: int


def _name_matches(name: Optional[str], query: str) -> bool:
    folded = (name or "").casefold()
    return all(word in folded for word in query.casefold().split())


def matches(row: Row, wanted: SessionFilter) -> bool:
    """Whether one session row passes every filter (the SQL part already held)."""
    if wanted.session_id is not None or wanted.display_name is not None:
        by_id = wanted.session_id is not None and row.session_id == wanted.session_id
        by_name = wanted.display_name is not None and _name_matches(row.display_name, wanted.display_name)
        if not (by_id or by_name):
            return False
    metadata = row.user_metadata or {}
    if any(key not in metadata or str(metadata[key]) != value for key, value in wanted.user_metadata.items()):
        return False
    if wanted.project_ids is not None and (row.project_id or DEFAULT_PROJECT) not in wanted.project_ids:
        return False
    if wanted.states is not None:
        if row.finished_at is None:
            if "active" not in wanted.states:
                return False
        elif not {"finished:*", f"finished:{row.finish_reason or 'success'}"} & wanted.states:
            return False
    return True


class SessionSearch:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def page(
        self,
        tenant: str,
        wanted: SessionFilter,
        limit: int,
        after: Optional[tuple[datetime, str]] = None,
    ) -> tuple[list[SessionHit], bool]:
        """Up to `limit` matching sessions after the cursor `(created_at, session_id)`, and
        whether more follow."""
        s = t.sessions.c
        query = select(t.sessions).where(s.tenant == tenant)
        if after is not None:
            created, session_id = after
            query = query.where(or_(s.created_at < created, and_(s.created_at == created, s.session_id > session_id)))
        query = query.order_by(s.created_at.desc(), s.session_id)
        hits: list[Row] = []
        with self.engine.connect() as conn:
            for row in conn.execute(query):
                if matches(row, wanted):
                    hits.append(row)
                    if len(hits) > limit:
                        break
            more = len(hits) > limit
            hits = hits[:limit]
            counts = self._checkpoint_counts(conn, tenant, [row.session_id for row in hits])
        return [SessionHit(row, *counts.get(row.session_id, (0, 0))) for row in hits], more

    @staticmethod
    def _checkpoint_counts(conn, tenant: str, session_ids: list[str]) -> dict[str, tuple[int, int]]:
        """(checkpoints, their bytes) per session, over the checkpoints of its training runs."""
        if not session_ids:
            return {}
        runs, cps = t.training_runs.c, t.checkpoints.c
        query = (
            select(runs.session_id, func.count(cps.checkpoint_id), func.coalesce(func.sum(cps.size_bytes), 0))
            .select_from(t.training_runs.join(t.checkpoints, cps.run_id == runs.model_id))
            .where(runs.tenant == tenant, cps.tenant == tenant, runs.session_id.in_(session_ids))
            .group_by(runs.session_id)
        )
        return {session_id: (int(count), int(size)) for session_id, count, size in conn.execute(query)}
