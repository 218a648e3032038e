"""The event store: appends events idempotently and folds them into projections.

One `append` is one transaction: the submission's dedup row (so a retried request gets its
first future back), the event row (unique by CloudEvent id, so a redelivered event is
stored once and applied once), the projection change, and, for gateway events bound for a
worker, an outbox row. The outbox row is deleted once the event is on the log; anything
left in it after a crash is published again on start (at-least-once, like the log itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

from sqlalchemy import bindparam, delete, insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from eventing.codec import Codec
from eventing.dedup import Dedup  # noqa: F401  (re-exported: the store's callers name it from here)
from eventing.store import projections
from eventing.store import tables as t
from openrl_core.errors import Conflict
from openrl_core.events import Event
from openrl_core.events.lifecycle import BlobRef


@dataclass(frozen=True)
class Appended:
    stored: bool  # False: this event id was already in the store
    duplicate_of: Optional[str] = None  # the first request id, when a submission repeats
    fenced: bool = False  # stored, but not applied: its lease was older than its key's fence


# Built once with bind parameters: a statement built per event, values as literals, cost
# more than running it (see projections).
_EVENT_INSERT = insert(t.events)
_SUBMISSION_INSERT = insert(t.submissions)
_SUBMISSION = select(t.submissions).where(
    t.submissions.c.tenant == bindparam("b_tenant"), t.submissions.c.dedup_key == bindparam("b_key")
)
_OUTBOX_DELETE = delete(t.outbox).where(t.outbox.c.event_id.in_(bindparam("b_ids", expanding=True)))
_FENCE = select(t.lease_fences.c.lease_id).where(
    t.lease_fences.c.tenant == bindparam("b_tenant"), t.lease_fences.c.key == bindparam("b_key")
)
_FENCE_UPDATE = update(t.lease_fences).where(
    t.lease_fences.c.tenant == bindparam("b_tenant"), t.lease_fences.c.key == bindparam("b_key")
)


class EventStore:
    def __init__(self, engine: Engine, codec: Codec) -> None:
        self.engine = engine
        self.codec = codec

    def append(self, event: Event, *, outbox_topic: Optional[str] = None, dedup: Optional[Dedup] = None) -> Appended:
        try:
            with self.engine.begin() as conn:
                duplicate = self._write(conn, event, outbox_topic, dedup)
                if duplicate is not None:
                    return duplicate
        except IntegrityError:
            if dedup is not None:
                # A concurrent twin won the race on the dedup row: answer like a retry.
                with self.engine.connect() as conn:
                    if self._seen(conn, event.tenant, dedup):
                        return Appended(stored=False, duplicate_of=self._earlier_submission(conn, event.tenant, dedup))
            if self.contains(event.id):
                return Appended(stored=False)
            raise
        return Appended(stored=True)

    def append_many(self, items: list[tuple[Event, Optional[str], Optional[Dedup]]]) -> list:
        """(event, outbox_topic, dedup) each, in one transaction; per item its `Appended`, or
        the Conflict (409) that item alone raised. A conflict is found before that item
        writes anything, so it leaves its neighbours' writes alone; any other failure rolls
        the batch back and every item is appended alone, each with its own answer."""
        outcomes: list = []
        try:
            with self.engine.begin() as conn:
                for event, outbox_topic, dedup in items:
                    try:
                        written = self._write(conn, event, outbox_topic, dedup)
                    except Conflict as conflict:
                        outcomes.append(conflict)
                        continue
                    outcomes.append(written if written is not None else Appended(stored=True))
        except Exception:
            return [self._append_alone(*item) for item in items]
        return outcomes

    def _append_alone(self, event: Event, outbox_topic: Optional[str], dedup: Optional[Dedup]):
        try:
            return self.append(event, outbox_topic=outbox_topic, dedup=dedup)
        except Exception as exc:
            return exc

    def append_batch(self, events: list[tuple[Event, Optional[Dedup]]]) -> int:
        """Append many events in one transaction (replay: one commit, one fsync, per batch
        instead of per event). Returns how many were new. If any collides with a row
        already stored, the batch is rolled back and appended one by one, which answers
        each collision as `append` does."""
        stored = 0
        try:
            with self.engine.begin() as conn:
                for event, dedup in events:
                    written = self._write(conn, event, None, dedup)
                    stored += written is None or written.fenced
        except IntegrityError:
            return sum(self.append(event, dedup=dedup).stored for event, dedup in events)
        return stored

    def _write(self, conn, event: Event, outbox_topic: Optional[str], dedup: Optional[Dedup]) -> Optional[Appended]:
        """Insert the event, its submission row and its projection changes; returns the
        answer for a repeated submission instead (and writes nothing)."""
        if dedup is not None:
            if self._seen(conn, event.tenant, dedup):
                return Appended(stored=False, duplicate_of=self._earlier_submission(conn, event.tenant, dedup))
            conn.execute(
                _SUBMISSION_INSERT,
                dict(
                    tenant=event.tenant,
                    dedup_key=dedup.key,
                    request_id=None if dedup.rejected else getattr(event.data, "request_id", None),
                    payload_sha256=dedup.payload_sha256,
                    rejected=dedup.rejected,
                ),
            )
        fenced = self._fenced(conn, event)
        data, claim = self.codec.pack(event)
        conn.execute(
            _EVENT_INSERT,
            dict(
                id=event.id,
                type=event.type,
                source=event.source,
                tenant=event.tenant,
                key=event.key,
                subject=event.subject,
                time=event.time,
                data=data or None,
                claim_sha256=claim.sha256 if claim else None,
                claim_size=claim.size if claim else None,
                dedup_key=dedup.key if dedup else None,
                dedup_sha256=dedup.payload_sha256 if dedup else None,
                dedup_rejected=dedup.rejected if dedup else None,
                lease_id=event.lease,
                fenced=True if fenced else None,
            ),
        )
        if fenced:
            return Appended(stored=True, fenced=True)
        projections.apply(conn, event)
        if outbox_topic is not None:
            conn.execute(insert(t.outbox).values(event_id=event.id, topic=outbox_topic))
        return None

    def _fenced(self, conn, event: Event) -> bool:
        """Fencing by lease: per (tenant, key), a training worker's events must carry
        non-decreasing leases. One carrying a lower lease than one already applied comes
        from a holder that lost its lease (paused past the deadline, replaced) and is
        refused; otherwise the key's fence moves up to it. Deterministic in log order, so a
        replay refuses exactly what the live store refused."""
        if event.lease is None or event.key is None or event.family != "training":
            return False
        fence = conn.execute(_FENCE, {"b_tenant": event.tenant, "b_key": event.key}).scalar()
        if fence is None:
            conn.execute(insert(t.lease_fences).values(tenant=event.tenant, key=event.key, lease_id=event.lease))
            return False
        if event.lease < fence:
            return True
        if event.lease > fence:
            conn.execute(_FENCE_UPDATE, {"b_tenant": event.tenant, "b_key": event.key, "lease_id": event.lease})
        return False

    def _seen(self, conn, tenant: str, dedup: Dedup) -> bool:
        """True when this exact submission was made before; a conflicting one raises."""
        row = conn.execute(_SUBMISSION, {"b_tenant": tenant, "b_key": dedup.key}).first()
        if row is None:
            return False
        what = dedup.key.split(":", 1)[-1]
        if row.rejected and not dedup.rejected:
            raise Conflict(f"{what} was already used by a refused request")
        if row.payload_sha256 != dedup.payload_sha256 or row.rejected != dedup.rejected:
            raise Conflict(f"{what} was already submitted with a different body")
        return True

    def _earlier_submission(self, conn, tenant: str, dedup: Dedup) -> Optional[str]:
        return conn.execute(
            select(t.submissions.c.request_id).where(t.submissions.c.tenant == tenant, t.submissions.c.dedup_key == dedup.key)
        ).scalar()

    def submitted(self, tenant: str, dedup: Dedup) -> bool:
        """Whether a submission under this identity is already stored (with any body)."""
        with self.engine.connect() as conn:
            return conn.execute(_SUBMISSION, {"b_tenant": tenant, "b_key": dedup.key}).first() is not None

    def contains(self, event_id: str) -> bool:
        with self.engine.connect() as conn:
            return conn.execute(select(t.events.c.id).where(t.events.c.id == event_id)).first() is not None

    def unpublished(self) -> list[tuple[Event, str, Optional[Dedup]]]:
        """Outbox events not yet on the log: (event, topic, its dedup identity)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(t.events, t.outbox.c.topic).join(t.outbox, t.outbox.c.event_id == t.events.c.id).order_by(t.events.c.position)
            ).all()
        return [(self._row_to_event(row), row.topic, _dedup_of(row)) for row in rows]

    def mark_published(self, event_id: str) -> None:
        self.mark_published_many([event_id])

    def mark_published_many(self, event_ids: list[str]) -> None:
        if not event_ids:
            return
        with self.engine.begin() as conn:
            conn.execute(_OUTBOX_DELETE, {"b_ids": event_ids})

    def read(self, after_position: int = 0, limit: int = 1000) -> list[tuple[int, Event]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(t.events).where(t.events.c.position > after_position).order_by(t.events.c.position).limit(limit)
            ).all()
        return [(row.position, self._row_to_event(row)) for row in rows]

    def iterate(self, batch: int = 1000) -> Iterator[tuple[int, Event]]:
        position = 0
        while True:
            chunk = self.read(position, batch)
            if not chunk:
                return
            yield from chunk
            position = chunk[-1][0]

    def read_with_dedup(self, after_position: int = 0, limit: int = 1000) -> list[tuple[int, Event, Optional[Dedup]]]:
        """Events in store order with the dedup identity each was appended under (for replay)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(t.events).where(t.events.c.position > after_position).order_by(t.events.c.position).limit(limit)
            ).all()
        return [(row.position, self._row_to_event(row), _dedup_of(row)) for row in rows]

    def event_of(self, row) -> Event:
        """The event of a row of the events table (read by a query of the caller's own)."""
        return self._row_to_event(row)

    def _row_to_event(self, row) -> Event:
        claim = BlobRef(sha256=row.claim_sha256, size=row.claim_size) if row.claim_sha256 else None
        return Event(
            id=row.id,
            type=row.type,
            source=row.source,
            time=projections.utc(row.time),
            tenant=row.tenant,
            key=row.key,
            subject=row.subject,
            lease=row.lease_id,
            data=self.codec.unpack(row.tenant, row.type, row.data, claim),
        )


def _dedup_of(row) -> Optional[Dedup]:
    return Dedup(row.dedup_key, row.dedup_sha256, bool(row.dedup_rejected)) if row.dedup_key else None
