"""Appends for a rebuild: a store's whole history folded into another store, batch by batch.

A rebuild (`openrl replay`, a restore from the log) appends events in their first order
through the same fold as the live path, so the tables it makes are the live ones exactly.
What differs is what it need not do when the target started empty: nothing is in the
database that the rebuild did not write itself, so one unit of work (`Rows`) is kept across
the batches, every row the fold asks for is already in memory or known absent, and no
batch reads anything back (the live path's prefetch queries, the known-ids query). An
event's inline payload is stored as the source stored it, not encoded again. Into a store
that already holds events (a restored backup replayed from the log), every batch reads what
it needs as the live path does.

Between batches the rebuild freezes what the process holds out of the cyclic garbage
collector's sight (`gc.freeze`; `close` undoes it): the rows kept and the decoded events are
many small containers, and every full collection walked them all again (about a third of a
rebuild's time, measured on SQLite). Within a batch the collector is off altogether
(`close` turns it back on): decoding and folding 2,000 events allocate far more than a
young generation, and its collections found nothing to free but still cost about 7% of a
rebuild (20,000 events on SQLite, alternating: 11,116 against 10,389 events/s). Reference
counting still frees everything as usual.

On SQLite the rebuild writes through one connection of its own with WAL checkpoints off,
and checkpoints once at the end: every batch's commit otherwise copied its pages into the
database and synced it (about a tenth of a rebuild on this machine's disk).

The rows kept are bounded (`keep`): past it they are dropped after a batch's commit and later
batches read from the database as the live path does, which is slower, never different.
"""

from __future__ import annotations

import gc
from typing import Optional

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from eventing.dedup import Dedup
from eventing.store import tables as t
from eventing.store.unit_of_work import Rows
from openrl_core.events import Event

# About 1 kB a row held: 500,000 is a few hundred MB, past a million events of history.
KEEP = 500_000


class Rebuilder:
    def __init__(self, store, keep: int = KEEP) -> None:
        self.store = store
        self.keep = keep
        with store.engine.connect() as conn:
            fresh = conn.execute(select(func.count()).select_from(t.events)).scalar() == 0
        self._rows: Optional[Rows] = Rows(None, fresh=True) if fresh else None
        self._known: Optional[set[str]] = set() if fresh else None  # ids stored, while fresh
        self._froze = False
        self._collecting: Optional[bool] = None  # whether the collector was on before the first batch
        self._conn = None  # SQLite: the rebuild's own connection, checkpointing once at the end

    def _connection(self):
        if self._conn is None:
            self._conn = self.store.engine.connect()
            if self._conn.dialect.name == "sqlite":
                self._conn.exec_driver_sql("PRAGMA wal_autocheckpoint=0")
                self._conn.commit()
        return self._conn

    @property
    def fresh(self) -> bool:
        """Whether batches still fold through the rows kept (the target held nothing else)."""
        return self._rows is not None

    def append(self, events: list[tuple[Event, Optional[Dedup]]], packed: Optional[list] = None) -> int:
        """Append `events` in one transaction; how many were new. `packed`: per event its
        (data, claim) as the source stored it, or None to encode it here."""
        if not self.fresh:
            return self.store.append_batch(events)
        if self._collecting is None:
            self._collecting = gc.isenabled()
            gc.disable()
        items = [(event, None, dedup) for event, dedup in events]
        if packed is not None:  # a claim-checked payload lives in the source's blob store: encoded again into ours
            packed = [pair if pair is not None and pair[1] is None else None for pair in packed]
        try:
            conn = self._connection()
            with conn.begin():
                outcomes, finished = self.store._fold_batch(conn, items, True, rows=self._rows, known=self._known, packed=packed)
        except IntegrityError:
            # Someone else wrote into the target: what this Rows holds may no longer be all
            # there is. Start over on the live path for this batch and the rest.
            self._drop()
            return self.store.append_batch(events)
        except BaseException:
            self._drop()  # the transaction rolled back: what the Rows holds was never written
            raise
        self.store.finished.put_many(finished)
        if self._rows.known() > self.keep or len(self._known) > self.keep:
            self._drop()
        gc.freeze()
        self._froze = True
        return sum(outcome.stored for outcome in outcomes)

    def close(self) -> None:
        """Checkpoint the SQLite WAL once, and hand what the batches froze back to the
        garbage collector."""
        if self._conn is not None:
            if self._conn.dialect.name == "sqlite":
                self._conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
                self._conn.exec_driver_sql("PRAGMA wal_autocheckpoint=1000")
                self._conn.commit()
            self._conn.close()
            self._conn = None
        if self._froze:
            gc.unfreeze()
            self._froze = False
        if self._collecting:
            gc.enable()
        self._collecting = None

    def _drop(self) -> None:
        self._rows, self._known = None, None
