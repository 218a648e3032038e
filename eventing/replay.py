"""Replay: rebuild every projection from the events alone, and diff it against the live one.

The events table is the source of truth. `rebuild` appends each stored event, in store
order and under the dedup identity it was first appended with, into a fresh, migrated
database; the projections fold exactly as they did live. `diff` then compares the rebuilt
tables with the live ones row by row. An empty diff is the proof that nothing the client
sees exists only in a table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from eventing.store.event_store import EventStore
from eventing.store.queries import Projections
from eventing.store.tables import metadata

# Every table folded from events. The outbox (in flight) and api_keys (configuration) are not.
PROJECTED = ("sessions", "training_runs", "checkpoints", "sampling_sessions", "futures", "submissions")


@dataclass
class ReplayReport:
    events: int
    seconds: float
    differences: list[str] = field(default_factory=list)

    @property
    def events_per_second(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else float("inf")


def rebuild(source: EventStore, target: EventStore, batch: int = 500) -> tuple[int, float]:
    """Append every source event to `target` in order; returns (events, seconds)."""
    started = time.perf_counter()
    count, position = 0, 0
    while True:
        chunk = source.read_with_dedup(position, batch)
        if not chunk:
            break
        # One transaction per chunk: the fold is the same, the commits (and fsyncs) are not.
        target.append_batch([(event, dedup) for _, event, dedup in chunk])
        count += len(chunk)
        position = chunk[-1][0]
    return count, time.perf_counter() - started


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
