"""Replay: rebuild every projection from the events alone, and diff it against the live one.

The events table is the source of truth. `rebuild` appends each stored event, in store
order and under the dedup identity it was first appended with, into a fresh, migrated
database; the projections fold exactly as they did live. `diff` then compares the rebuilt
tables with the live ones row by row. An empty diff is the proof that nothing the client
sees exists only in a table.

The log can be the source instead of the store (`read_log`): every event the store holds
was published to the log too, with its dedup identity. Topics are ordered only per
partition, so the events of all topics are merged by their CloudEvent time (a request
before its own lifecycle events at equal times); on several machines that assumes their
clocks agree to within the time a worker takes to answer. Replaying from an offset into a
restored backup of the store is safe however early it starts: an event already stored is
skipped by its id.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Generator, Optional, Sequence

from eventing import topics
from eventing.bus import EventBus
from eventing.codec import Codec
from eventing.dedup import Dedup
from eventing.store.event_store import EventStore
from eventing.store.queries import Projections
from eventing.store.tables import metadata
from openrl_core.events import Event

# Every table folded from events. The outbox (in flight) and api_keys (configuration) are not.
PROJECTED = (
    "sessions", "training_runs", "run_steps", "checkpoints", "removed_checkpoints", "sampling_sessions", "futures",
    "submissions", "lease_fences",
)  # fmt: skip


@dataclass
class ReplayReport:
    events: int
    seconds: float
    differences: list[str] = field(default_factory=list)

    @property
    def events_per_second(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else float("inf")


def rebuild(source: EventStore, target: EventStore, batch: int = 1000) -> tuple[int, float]:
    """Append every source event to `target` in order; returns (events, seconds).

    From PostgreSQL the next chunk's rows are fetched on a thread while this one is decoded
    and folded (`_fetch_ahead`): the query is the server's work, during which the fetching
    thread only waits, with the GIL released. From SQLite the query is this process's own
    work and is not moved: on a thread it would only contend for the GIL with the fold."""
    started = time.perf_counter()
    count = 0
    rebuilder = target.rebuilder()
    ahead = source.engine.dialect.name == "postgresql"
    fetched = _fetch_ahead(source, batch) if ahead else _fetch(source, batch)
    try:
        for rows in fetched:
            chunk = source.decode_packed(rows)
            # One transaction per chunk: the fold is the same, the commits (and fsyncs) are not,
            # and the unit of work reads and writes a chunk's rows in a few statements.
            rebuilder.append([(event, dedup) for _, event, dedup, _p in chunk], [packed for *_e, packed in chunk])
            count += len(chunk)
    finally:
        fetched.close()
        rebuilder.close()
    return count, time.perf_counter() - started


def _fetch(source: EventStore, batch: int) -> Generator[Sequence[Any], None, None]:
    """The source's events table in store order, `batch` rows at a time, as fetched."""
    position = 0
    while rows := source.fetch_packed(position, batch):
        yield rows
        position = rows[-1][0]


def _fetch_ahead(source: EventStore, batch: int) -> Generator[Sequence[Any], None, None]:
    """`_fetch`, one chunk ahead on a thread of its own; its error is raised here, and
    closing the generator stops the thread."""
    chunks: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()

    def fetch() -> None:
        try:
            for rows in _fetch(source, batch):
                if not _hand_over(chunks, stop, rows):
                    return
            _hand_over(chunks, stop, [])
        except BaseException as exc:
            _hand_over(chunks, stop, exc)

    fetcher = threading.Thread(target=fetch, name="replay-fetcher", daemon=True)
    fetcher.start()
    try:
        while True:
            rows = chunks.get()
            if isinstance(rows, BaseException):
                raise rows
            if not rows:
                return
            yield rows
    finally:
        stop.set()
        fetcher.join()


def _hand_over(chunks: queue.Queue, stop: threading.Event, item) -> bool:
    """Put `item` in the queue unless the consumer went away meanwhile; whether it went in."""
    while not stop.is_set():
        try:
            chunks.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def read_log(
    bus: EventBus, codec: Codec, from_offset: int = 0, first_wait: float = 30.0, idle: float = 3.0
) -> list[tuple[Event, Optional[Dedup]]]:
    """Every event on every OpenRL topic at offset `from_offset` or later in its partition,
    merged into one causal order. The log has no end marker: reading stops once nothing
    has arrived for `idle` seconds (after the first record, or after `first_wait`)."""
    consumer = bus.consumer(f"openrl-replay-{uuid.uuid4().hex[:8]}", pattern=topics.everything(), from_beginning=True)
    seen: dict[str, tuple[Event, Optional[Dedup]]] = {}
    started = last = time.monotonic()
    try:
        while True:
            records = consumer.poll(max_records=1000, timeout=0.5)
            now = time.monotonic()
            if records:
                last = now
            elif now - last >= (idle if seen or now - started >= first_wait else first_wait):
                break
            for record in records:
                if record.offset >= from_offset:
                    event, dedup = codec.decode_with_dedup(record.message)
                    seen.setdefault(event.id, (event, dedup))  # a republished outbox event comes twice
    finally:
        consumer.close()
    return sorted(seen.values(), key=lambda pair: (pair[0].time, _PHASE_ORDER.get(pair[0].phase, 2)))


_PHASE_ORDER = {"requested": 0, "started": 1}


def rebuild_from_events(
    events: list[tuple[Event, Optional[Dedup]]], target: EventStore, batch: int = 2000
) -> tuple[int, float]:
    """Append (event, dedup) pairs to `target` in the given order; returns (new events, seconds)."""
    started = time.perf_counter()
    rebuilder = target.rebuilder()
    try:
        stored = sum(rebuilder.append(events[i : i + batch]) for i in range(0, len(events), batch))
        stored += rebuilder.settle()  # the last batch, if still in flight, and what it changed
    finally:
        rebuilder.close()
    return stored, time.perf_counter() - started


def diff(live: Projections, rebuilt: Projections, tables: tuple[str, ...] = PROJECTED) -> list[str]:
    differences: list[str] = []
    for table in tables:
        primary = [column.name for column in metadata.tables[table].primary_key.columns]
        left = {tuple(row[c] for c in primary): row for row in live.table_rows(table)}
        right = {tuple(row[c] for c in primary): row for row in rebuilt.table_rows(table)}
        for key in sorted(set(left) | set(right), key=str):
            if key not in right:
                differences.append(f"{table} {key}: only in the live store")
            elif key not in left:
                differences.append(f"{table} {key}: only in the replay")
            elif left[key] != right[key]:
                changed = sorted(k for k in left[key] if left[key][k] != right[key].get(k))
                differences.append(f"{table} {key}: columns differ: {changed}")
    return differences


def replay(source: EventStore, live: Projections, target: EventStore, rebuilt: Projections) -> ReplayReport:
    events, seconds = rebuild(source, target)
    return ReplayReport(events, seconds, diff(live, rebuilt))
