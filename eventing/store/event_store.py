"""The event store: appends events idempotently and folds them into projections.

One append is one transaction, for one event or a batch: per event its submission's dedup
row (so a retried request gets its first future back), the event row (unique by CloudEvent
id, so a redelivered event is stored once and applied once), its projection change and, for
gateway events bound for a worker, an outbox row. The projections fold through the
transaction's unit of work (`unit_of_work.Rows`): the rows a batch needs are read in a few
queries up front and its changes written back in a few executemany statements at the end,
so a batch costs about the same number of statements as one event. The outbox row is
deleted once the event is on the log; anything left in it after a crash is published again
(at-least-once, like the log itself).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, cast

from sqlalchemy import bindparam, insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from eventing.codec import Codec
from eventing.dedup import Dedup  # noqa: F401  (re-exported: the store's callers name it from here)
from eventing.store import projections
from eventing.store import tables as t
from eventing.store.driver_reads import driver_mark
from eventing.store.driver_writes import driver_execute, execute_many
from eventing.store.finished import FinishedFutures
from eventing.store.kept import kept
from eventing.store.known_runs import IGNORED as RUN_COLUMNS_NOT_KEPT
from eventing.store.known_runs import KnownRuns
from eventing.store.rebuilding import Rebuilder
from eventing.store.unit_of_work import Rows, utc
from openrl_core.errors import Conflict
from openrl_core.events import Event
from openrl_core.events.lifecycle import BlobRef


@dataclass(frozen=True)
class Appended:
    stored: bool  # False: this event id was already in the store
    duplicate_of: Optional[str] = None  # the first request id, when a submission repeats
    fenced: bool = False  # stored, but not applied: its lease was older than its key's fence


# The common outcomes, made once (frozen, so shared): one per event of every batch.
_STORED, _FENCED, _REDELIVERED = Appended(stored=True), Appended(stored=True, fenced=True), Appended(stored=False)

# Built once with bind parameters: a statement built per call, values as literals, cost
# more than running it.
_EVENT_INSERT = insert(t.events)
_OUTBOX_INSERT = insert(t.outbox)
_KNOWN_IDS = select(t.events.c.id).where(t.events.c.id.in_(bindparam("b_ids", expanding=True)))
_EVENTS_BY_ID = select(t.events).where(t.events.c.id.in_(bindparam("b_ids", expanding=True)))
_SUBMISSION = select(t.submissions).where(
    t.submissions.c.tenant == bindparam("b_tenant"), t.submissions.c.dedup_key == bindparam("b_key")
)
# The payload fields whose rows the fold reads, prefetched for a whole batch in one query each.
_PREFETCH = (
    ("futures", "request_id"),
    ("training_runs", "model_id"),
    ("sessions", "session_id"),
    ("sampling_sessions", "sampling_session_id"),
)
_STEP_COMPLETIONS = ("ai.openrl.training.forward_backward.completed.v1", "ai.openrl.training.optim_step.completed.v1")


class EventStore:
    def __init__(self, engine: Engine, codec: Codec, finished_cached: int = 1024) -> None:
        self.engine = engine
        self.codec = codec
        # Futures finished by this process's transactions, for the long-polls beside them.
        self.finished = FinishedFutures(finished_cached)
        # Runs' rows for the gateway's lookups, where this process sees every change (known_runs.py).
        self.runs = KnownRuns()
        self._announcing_runs = False
        # SQLite lets one connection write at a time and makes the others wait by sleeping
        # and trying again (1, 2, 5, 10, 15, 20 ms, ... up to the busy timeout): under load the
        # gateway's writer and the projector, which both write here, slept on each other so
        # (strace of the futures bench's server: about 130 such sleeps, 0.6 s, in 5 s). Taking
        # turns on a lock of this process instead hands over the moment a writer commits.
        # Another process writing the same file (an `openrl` command) still meets SQLite's wait.
        self._writing = threading.Lock() if engine.dialect.name == "sqlite" else contextlib.nullcontext()
        # The writers (the group-commit thread, the projector) each keep a connection on a
        # SQLite file instead of a pool checkout per transaction (eventing/store/kept.py).
        self._kept = kept(engine)

    def announce_runs(self) -> None:
        """From now on, a transaction that changes training runs also announces them, with a
        NOTIFY of its own (PostgreSQL; delivered when, and only if, it commits): gateways in
        other processes drop their kept rows of them (known_runs.py)."""
        if self.engine.dialect.name != "postgresql":
            raise ValueError("runs are announced through PostgreSQL's NOTIFY")
        self._announcing_runs = True

    def append(self, event: Event, *, outbox_topic: Optional[str] = None, dedup: Optional[Dedup] = None) -> Appended:
        """Raises Conflict when the submission's identity was used with another body."""
        outcome = self.append_many([(event, outbox_topic, dedup)])[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def append_many(
        self, items: Sequence[tuple[Event, Optional[str], Optional[Dedup]]], published: Sequence[str] = ()
    ) -> list:
        """(event, outbox_topic, dedup) each, in one transaction; per item its `Appended`, or
        the Conflict (409) that item alone raised. A conflict is found before that item
        writes anything, so it leaves its neighbours' writes alone; any other failure (a
        concurrent writer's twin row) rolls the batch back and every item is appended alone,
        each with its own answer. `published`: ids of events the log has acknowledged, whose
        outbox rows go too (in the same transaction; in one of their own if the batch falls
        back to single appends): once this returns, they are gone."""
        try:
            with self._writing, self._kept.begin(rows=len(items) + len(published)) as conn:
                outcomes, finished, runs = self._fold_batch(conn, items, raise_conflicts=False)
                _delete_outbox_rows(conn, published)
        except IntegrityError:
            self.mark_published_many(list(published))
            if len(items) > 1:
                return [self._append_alone(*item) for item in items]
            event, _topic, dedup = items[0]
            raced = self._after_race(event, dedup)
            if raced is None:
                raise
            return [raced]
        self.finished.put_many(finished)  # committed: their rows are the store's now
        self.runs.changed(runs)
        return outcomes

    def _append_alone(self, event: Event, outbox_topic: Optional[str], dedup: Optional[Dedup]):
        try:
            return self.append(event, outbox_topic=outbox_topic, dedup=dedup)
        except Exception as exc:
            return exc

    def _after_race(self, event: Event, dedup: Optional[Dedup]) -> Optional[Appended]:
        """The answer for an append that lost a race to a concurrent twin (another process
        stored the same submission or event id first), or None if it is something else."""
        with self.engine.connect() as conn:
            if dedup is not None:
                row = conn.execute(_SUBMISSION, {"b_tenant": event.tenant, "b_key": dedup.key}).first()
                if row is not None:
                    _check_same(row, dedup)
                    return Appended(stored=False, duplicate_of=row.request_id)
            if conn.execute(_KNOWN_IDS, {"b_ids": [event.id]}).first() is not None:
                return Appended(stored=False)
        return None

    def append_batch(self, events: list[tuple[Event, Optional[Dedup]]]) -> int:
        """Append many events in one transaction (the projector's poll, replay's batches).
        Returns how many were new. A conflicting submission raises and stores nothing of the
        batch; a row a concurrent writer stored first rolls the batch back and the events are
        appended one by one, which answers each collision as `append` does."""
        try:
            with self._writing, self._kept.begin(rows=len(events)) as conn:
                outcomes, finished, runs = self._fold_batch(
                    conn, [(event, None, dedup) for event, dedup in events], raise_conflicts=True
                )
        except IntegrityError:
            return sum(self.append(event, dedup=dedup).stored for event, dedup in events)
        self.finished.put_many(finished)
        self.runs.changed(runs)
        return sum(outcome.stored for outcome in outcomes)

    def _fold_batch(
        self, conn, items, raise_conflicts: bool, rows: Optional[Rows] = None, known: Optional[set] = None, packed=None
    ) -> tuple[list, list, list]:
        """(per item its outcome, the futures rows it changed, the runs whose kept rows it
        makes stale) once written; `rows` and `known` (the ids stored) are a rebuild's own,
        kept across its batches; `packed`: per item its stored (data, claim) as another store
        holds it, copied as is."""
        if rows is None:
            rows = Rows(conn)
        rows.conn = conn
        found = self._prefetch(rows, items, None if known is not None else list({event.id for event, _t, _d in items}))
        if known is None:
            known = found if found is not None else set()  # (found: the ids were asked for)
        outcomes: list = []
        event_rows, outbox_rows = [], []
        for index, (event, outbox_topic, dedup) in enumerate(items):
            if event.id in known:  # a redelivery (or a repeat within the batch)
                outcomes.append(_REDELIVERED)
                continue
            try:
                outcome = self._fold(rows, event, dedup)
            except Conflict as conflict:
                if raise_conflicts:
                    raise
                outcomes.append(conflict)
                continue
            outcomes.append(outcome)
            if not outcome.stored:
                continue
            known.add(event.id)
            event_rows.append(self._event_row(event, dedup, outcome.fenced, packed[index] if packed else None))
            if outbox_topic is not None and not outcome.fenced:
                outbox_rows.append({"event_id": event.id, "topic": outbox_topic})
        execute_many(conn, _EVENT_INSERT, event_rows)
        execute_many(conn, _OUTBOX_INSERT, outbox_rows)
        # FinishedFutures keeps the terminal ones, for long-polls beside this store; a fresh
        # Rows is a rebuild's, into a store no long-poll reads while it is made (a miss there
        # only means a read), and copying its every future cost about 3% of the rebuild.
        finished = [dict(row) for row in rows.changed("futures")] if not rows.fresh else []
        runs = []
        if (self.runs.following or self._announcing_runs) and not rows.fresh:
            runs = [key[0] for key in rows.changed_keys("training_runs", RUN_COLUMNS_NOT_KEPT)]
        rows.flush()
        if runs and self._announcing_runs:
            from eventing.pg_notify import CHANNEL, run_pieces  # (it imports the store's database module)

            driver_execute(conn, "SELECT pg_notify(%s, %s)", [(CHANNEL, piece) for piece in run_pieces(runs)])
        return outcomes, finished, runs

    def _prefetch(self, rows: Rows, items, ids: Optional[list[str]] = None) -> Optional[set[str]]:
        """Read, in one query per table, the rows the batch's fold will ask for, and which of
        `ids` (the batch's event ids) the store holds already (None when `ids` is None). A
        fresh `Rows` (a rebuild's) reads no rows: it already knows every row there is. The
        queries that depend on nothing go together: on PostgreSQL one round trip for all
        (`driver_reads.driver_rows_many`)."""
        also = _known_ids_queries(rows.conn.dialect, ids) if ids is not None else []
        first: list[tuple[str, Iterable[tuple]]] = [
            ("submissions", [(event.tenant, dedup.key) for event, _t, dedup in items if dedup is not None]),
            ("lease_fences", [(event.tenant, event.key) for event, _t, _d in items if _leased(event)]),
        ]
        first += [
            (table, [(value,) for event, _t, _d in items if (value := _field(event.data, field))])
            for table, field in _PREFETCH
        ]
        answers = rows.prefetch_many(first if not rows.fresh else [], also=also)
        known = {row[0] for raw, _description in answers for row in raw} if ids is not None else None
        if rows.fresh:
            return known
        # What completions reach through their future: its run, and the run's latest step.
        futures = [
            (event, rows.get("futures", request_id))
            for event, _t, _d in items
            if (request_id := _field(event.data, "request_id"))
        ]
        rows.prefetch(
            "training_runs", [(future["model_id"],) for _event, future in futures if future and future["model_id"]]
        )
        stepping = sorted(
            {
                future["model_id"]
                for event, future in futures
                if future and future["model_id"] and event.type in _STEP_COMPLETIONS
            }
        )
        if stepping:
            rows.prefetch_latest("run_steps", "step", "model_id", stepping)
        return known

    def _fold(self, rows: Rows, event: Event, dedup: Optional[Dedup]) -> Appended:
        """The submission (dedup), the lease fence and the projection change of one event;
        a repeated submission writes nothing and answers with its first future."""
        if dedup is not None:
            earlier = rows.get("submissions", event.tenant, dedup.key)
            if earlier is not None:
                _check_same(earlier, dedup)
                return Appended(stored=False, duplicate_of=earlier["request_id"])
            rows.insert(
                "submissions",
                tenant=event.tenant,
                dedup_key=dedup.key,
                request_id=None if dedup.rejected else getattr(event.data, "request_id", None),
                payload_sha256=dedup.payload_sha256,
                rejected=dedup.rejected,
            )
        if self._fenced(rows, event):
            return _FENCED
        projections.apply(rows, event)
        return _STORED

    @staticmethod
    def _fenced(rows: Rows, event: Event) -> bool:
        """Fencing by lease: per (tenant, key), a training worker's events must carry
        non-decreasing leases. One carrying a lower lease than one already applied comes
        from a holder that lost its lease (paused past the deadline, replaced) and is
        refused; otherwise the key's fence moves up to it. Deterministic in log order, so a
        replay refuses exactly what the live store refused."""
        if not _leased(event):
            return False
        fence = rows.get("lease_fences", event.tenant, event.key)
        if fence is None:
            rows.insert("lease_fences", tenant=event.tenant, key=event.key, lease_id=event.lease)
            return False
        if event.lease < fence["lease_id"]:
            return True
        if event.lease > fence["lease_id"]:
            rows.update("lease_fences", (event.tenant, event.key), lease_id=event.lease)
        return False

    def _event_row(self, event: Event, dedup: Optional[Dedup], fenced: bool, packed=None) -> dict:
        data, claim = packed if packed is not None else self.codec.pack(event)
        return dict(
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
        )

    def submitted(self, tenant: str, dedup: Dedup) -> bool:
        """Whether a submission under this identity is already stored (with any body)."""
        with self.engine.connect() as conn:
            return conn.execute(_SUBMISSION, {"b_tenant": tenant, "b_key": dedup.key}).first() is not None

    def contains(self, event_id: str) -> bool:
        with self.engine.connect() as conn:
            return conn.execute(_KNOWN_IDS, {"b_ids": [event_id]}).first() is not None

    def unpublished(self) -> list[tuple[Event, str, Optional[Dedup]]]:
        """Outbox events not yet on the log: (event, topic, its dedup identity)."""
        # The outbox first, then its events by id: as one join ordered by position, SQLite
        # walked every stored event to find the few in the outbox (its plan: SCAN events),
        # and the relay asks every few seconds while it holds the appender's writer.
        with self.engine.connect() as conn:
            topics = dict(conn.execute(select(t.outbox.c.event_id, t.outbox.c.topic)).all())
            ids = list(topics)
            rows = [
                row
                for start in range(0, len(ids), 500)
                for row in conn.execute(_EVENTS_BY_ID, {"b_ids": ids[start : start + 500]})
            ]
        rows.sort(key=lambda row: row.position)
        return [(self._row_to_event(row), topics[row.id], _dedup_of(row)) for row in rows]

    def mark_published(self, event_id: str) -> None:
        self.mark_published_many([event_id])

    def mark_published_many(self, event_ids: list[str]) -> None:
        if not event_ids:
            return
        with self._writing, self._kept.begin(rows=len(event_ids)) as conn:
            _delete_outbox_rows(conn, event_ids)

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
        return [(position, event, dedup) for position, event, dedup, _packed in self.read_packed(after_position, limit)]

    def read_packed(
        self, after_position: int = 0, limit: int = 1000
    ) -> list[tuple[int, Event, Optional[Dedup], tuple]]:
        """`read_with_dedup`, and per event its payload as stored: (data, claim), for a
        rebuild to store without encoding it again.

        Replay reads every event through here, so the rows come as the driver's tuples, not
        SQLAlchemy rows: their per-row bookkeeping and SQLite's datetime parsing (a regular
        expression a row) were a tenth of a rebuild. SQLite hands `time` back as the text
        SQLAlchemy stored, which `datetime.fromisoformat` reads (the tests compare the two
        readings)."""
        return self.decode_packed(self.fetch_packed(after_position, limit))

    def fetch_packed(self, after_position: int = 0, limit: int = 1000) -> Sequence[Any]:
        """`read_packed`'s rows as the driver gives them, not decoded yet (`decode_packed`)."""
        with self.engine.connect() as conn:
            return conn.exec_driver_sql(_packed_sql(conn.dialect), (after_position, limit)).fetchall()

    def decode_packed(self, rows: Sequence[Any]) -> list[tuple[int, Event, Optional[Dedup], tuple]]:
        parse = _text_time if self.engine.dialect.name == "sqlite" else _event_time
        unpack, stored, packed = self.codec.unpack, Event.stored, []
        for (
            position,
            id_,
            type_,
            source,
            tenant,
            key,
            subject,
            time,
            data,
            sha,
            size,
            lease,
            dkey,
            dsha,
            drejected,
        ) in rows:
            data, claim = bytes(data or b""), _claim(sha, size)
            event = stored(id=id_, type=type_, source=source, time=parse(time), tenant=tenant, key=key, subject=subject,
                           lease=lease, data=unpack(tenant, type_, data, claim))  # fmt: skip
            packed.append((position, event, _dedup(dkey, dsha, drejected), (data, claim)))
        return packed

    def rebuilder(self) -> Rebuilder:
        """Appends for a rebuild of this store from another's events (see `Rebuilder`)."""
        return Rebuilder(self)

    def event_of(self, row) -> Event:
        """The event of a row of the events table (read by a query of the caller's own)."""
        return self._row_to_event(row)

    def _row_to_event(self, row) -> Event:
        claim = _claim_of(row)
        # Constructed, not validated: the row was an Event when it was stored, and its payload
        # is validated by `unpack` (validating the envelope again cost more than the payload).
        return Event.stored(
            id=row.id,
            type=row.type,
            source=row.source,
            time=utc(cast(datetime, row.time)),  # the column is NOT NULL
            tenant=row.tenant,
            key=row.key,
            subject=row.subject,
            lease=row.lease_id,
            data=self.codec.unpack(row.tenant, row.type, row.data, claim),
        )


_PACKED_COLUMNS = (
    "position", "id", "type", "source", "tenant", "key", "subject", "time", "data", "claim_sha256", "claim_size", "lease_id",
    "dedup_key", "dedup_sha256", "dedup_rejected",
)  # fmt: skip


@functools.lru_cache(maxsize=4)
def _packed_sql(dialect) -> str:
    """`read_packed`'s query for one dialect, with two positional parameters (after, limit)."""
    quote = dialect.identifier_preparer.quote
    mark = driver_mark(dialect)
    columns = ", ".join(quote(name) for name in _PACKED_COLUMNS)
    position = quote("position")
    return f"SELECT {columns} FROM {quote('events')} WHERE {position} > {mark} ORDER BY {position} LIMIT {mark}"


def _known_ids_queries(dialect, ids: list[str]) -> list[tuple[str, list[str]]]:
    """The reads, as (sql, params) in bounded IN lists, of which of `ids` the events table
    holds (driver SQL, as the unit of work reads: `driver_reads._Reader` says why)."""
    chunks = [ids[start : start + 500] for start in range(0, len(ids), 500)]
    return [(_id_list_sql(dialect, "select", "events", "id", len(chunk)), chunk) for chunk in chunks]


def _delete_outbox_rows(conn, event_ids: Sequence[str]) -> None:
    for start in range(0, len(event_ids), 500):
        chunk = list(event_ids[start : start + 500])
        driver_execute(conn, _id_list_sql(conn.dialect, "delete", "outbox", "event_id", len(chunk)), [chunk])


@functools.lru_cache(maxsize=512)
def _id_list_sql(dialect, action: str, table: str, column: str, count: int) -> str:
    """Driver SQL that selects ("select") or deletes ("delete") the rows of `table` whose
    `column` is among `count` parameters, built once per dialect and count (the known-ids
    check, the outbox clean-up)."""
    quote, mark = dialect.identifier_preparer.quote, driver_mark(dialect)
    head = f"SELECT {quote(column)}" if action == "select" else "DELETE"
    return f"{head} FROM {quote(table)} WHERE {quote(column)} IN ({', '.join([mark] * count)})"


# `utc` of the events' time, a NOT NULL column (never None).
_event_time: Callable[[Any], datetime] = utc


def _text_time(value) -> datetime:
    """A SQLite DateTime column's text ("YYYY-MM-DD HH:MM:SS.ffffff"), as UTC (the events'
    time, a NOT NULL column)."""
    if isinstance(value, datetime):
        return utc(value)
    return datetime.fromisoformat(value).replace(tzinfo=timezone.utc)


def _field(data, name: str):
    """A payload's field, or None when its kind has none (what getattr with a default gives,
    without pydantic's slow path for a missing attribute)."""
    return vars(data).get(name)


def _leased(event: Event) -> bool:
    return event.lease is not None and event.key is not None and event.family == "training"


def _check_same(earlier, dedup: Dedup) -> None:
    """A submission made again must be the same one; a conflicting one raises Conflict."""
    row = earlier if isinstance(earlier, dict) else earlier._mapping
    what = dedup.key.split(":", 1)[-1]
    if row["rejected"] and not dedup.rejected:
        raise Conflict(f"{what} was already used by a refused request")
    if row["payload_sha256"] != dedup.payload_sha256 or bool(row["rejected"]) != dedup.rejected:
        raise Conflict(f"{what} was already submitted with a different body")


def _claim(sha256: Optional[str], size: Optional[int]) -> Optional[BlobRef]:
    """An events row's claim check, from its claim_sha256 and claim_size columns."""
    # The two columns are written together; BlobRef refuses a None size, as it always did.
    return BlobRef(sha256=sha256, size=cast(int, size)) if sha256 else None


def _dedup(key: Optional[str], sha256: Optional[str], rejected) -> Optional[Dedup]:
    """An events row's dedup identity, from its dedup_key, dedup_sha256 and dedup_rejected columns."""
    return Dedup(key, cast(str, sha256), bool(rejected)) if key else None  # written with the key


def _claim_of(row) -> Optional[BlobRef]:
    return _claim(row.claim_sha256, row.claim_size)


def _dedup_of(row) -> Optional[Dedup]:
    return _dedup(row.dedup_key, row.dedup_sha256, row.dedup_rejected)
