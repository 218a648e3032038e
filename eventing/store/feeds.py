"""A sampling session's completion feed, read straight from the events table.

The cursor is the events table's `position`: a sample's completion is the first terminal
event (completed, failed or cancelled) whose key is the sampling session, so "everything
after cursor C" needs no table of its own and survives restarts. Positions of one sampling
session's completions grow in commit order because one writer appends them: the projector
consuming the partition that the session's key maps to. A redelivered completion (the log
is at-least-once) is a second terminal event for the same request; only the first counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, cast

from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from eventing.codec import Codec
from eventing.store import tables as t
from openrl_core.events.lifecycle import BlobRef
from openrl_core.events.sampling import SAMPLE, SAMPLE_CANCELLED, SampleRequested
from openrl_core.futures import FutureState

OUTCOME: dict[str, Literal["finished", "failed"]] = {
    SAMPLE["completed"]: "finished",
    SAMPLE["failed"]: "failed",
    SAMPLE_CANCELLED: "failed",
}


@dataclass(frozen=True)
class SampleCompletion:
    position: int
    request_id: str
    outcome: Literal["finished", "failed"]
    seq_id: Optional[int]  # the sample's seq_id, None if its request event is missing


@dataclass(frozen=True)
class FeedPage:
    completions: list[SampleCompletion]
    cursor: int  # the last position read, reported or not
    more: bool = False  # the page is full: completions after `cursor` may already be waiting


class SampleFeed:
    def __init__(self, engine: Engine, codec: Codec) -> None:
        self.engine = engine
        self.codec = codec

    def after(self, tenant: str, sampling_session_id: str, cursor: int, limit: int = 1000) -> FeedPage:
        events = t.events
        of_session = (events.c.tenant == tenant, events.c.key == sampling_session_id, events.c.type.in_(OUTCOME))
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(events.c.position, events.c.type, events.c.subject)
                .where(*of_session, events.c.position > cursor)
                .order_by(events.c.position)
                .limit(limit)
            ).all()
            if not rows:
                return FeedPage([], cursor)
            ids = {row.subject for row in rows}
            first = dict(
                conn.execute(
                    select(events.c.subject, func.min(events.c.position))
                    .where(*of_session, events.c.subject.in_(ids))
                    .group_by(events.c.subject)
                ).all()
            )
            requests = conn.execute(
                select(events).where(
                    events.c.tenant == tenant,
                    events.c.key == sampling_session_id,
                    events.c.type == SAMPLE["requested"],
                    events.c.subject.in_(ids),
                )
            ).all()
        seq_ids = {row.subject: self._seq_id(row) for row in requests}
        completions = [
            SampleCompletion(row.position, row.subject, OUTCOME[row.type], seq_ids.get(row.subject))
            for row in rows
            if first.get(row.subject) == row.position
        ]
        return FeedPage(completions, rows[-1].position, more=len(rows) == limit)

    def _seq_id(self, row) -> int:
        claim = BlobRef(sha256=row.claim_sha256, size=row.claim_size) if row.claim_sha256 else None
        return cast(SampleRequested, self.codec.unpack(row.tenant, row.type, row.data, claim)).seq_id

    def pending(self, tenant: str, session_id: str, sampling_session_id: str) -> list[str]:
        """Request ids of the session's samples that are not finished yet."""
        futures = t.futures
        query = select(futures.c.request_id).where(
            futures.c.tenant == tenant,
            futures.c.session_id == session_id,  # indexed with tenant
            futures.c.model_id == sampling_session_id,
            futures.c.kind == "sample",
            futures.c.state.in_([FutureState.PENDING.value, FutureState.RUNNING.value]),
        )
        with self.engine.connect() as conn:
            return list(conn.execute(query).scalars())

    def results(self, tenant: str, request_ids: list[str]) -> dict[str, dict]:
        futures = t.futures
        if not request_ids:
            return {}
        query = select(futures.c.request_id, futures.c.result).where(
            futures.c.tenant == tenant, futures.c.request_id.in_(request_ids)
        )
        with self.engine.connect() as conn:
            return {row.request_id: row.result for row in conn.execute(query) if row.result is not None}
