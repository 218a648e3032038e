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

A batch's writes are made ready to send (`DeferredWrites`) and sent while the next batch
is read and folded; batches still commit one at a time and in order, and one that fails
because another writer stored a row first is appended again on the live path. Into a
PostgreSQL store a thread sends them (COPY for its inserts; `_Writer`): the server does the
work while the thread waits with the GIL released. Into a SQLite file a process of its own
does (`sqlite_writer`): SQLite's work is the writing process's own, and a thread would hold
the GIL at every row. A SQLite database that is not a file (in memory) is written in this
process, batch after batch.

The rows kept are bounded (`keep`): past it they are dropped after a batch's commit and later
batches read from the database as the live path does, which is slower, never different.
"""

from __future__ import annotations

import gc
import sqlite3
import threading
from typing import Any, Optional, cast

from sqlalchemy import func, select
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError

from eventing.dedup import Dedup
from eventing.store import tables as t
from eventing.store.driver_writes import DeferredWrites, copy_context
from eventing.store.sqlite_writer import SqliteWriter
from eventing.store.unit_of_work import Rows
from openrl_core.events import Event

# About 1 kB a row held: 500,000 is a few hundred MB, past a million events of history.
KEEP = 500_000


class _Writer:
    """One batch's writes in flight on a thread of its own, with what to do once they are
    committed. On PostgreSQL a batch's writes are mostly the server's work (COPY into
    indexed tables, about a third of a rebuild's time), during which this process only
    waits with the GIL released: sent from a thread, they overlap the next batch's read
    and fold instead of following them. The batch's rows are formatted before it starts
    (`DeferredWrites`), so the thread holds the GIL only briefly, and batches still commit
    one at a time, in order."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._thread: Optional[threading.Thread] = None
        self._batch = None
        self._error: Optional[BaseException] = None

    def writes(self) -> DeferredWrites:
        """An empty batch of writes to fold into, its COPY rows formatted as they come."""
        return DeferredWrites(self._conn.dialect, copy_context(self._conn))

    def start(self, writes: DeferredWrites, batch) -> None:
        conn = self._conn

        def run() -> None:
            try:
                with conn.begin():
                    writes.run(conn)
            except BaseException as exc:  # handed to whoever waits
                self._error = exc

        self._batch, self._error = batch, None
        self._thread = threading.Thread(target=run, name="rebuild-writer", daemon=True)
        self._thread.start()

    def wait(self) -> Optional[tuple[Any, Optional[BaseException]]]:
        """None when nothing is in flight, else (the batch, its error or None)."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        return self._batch, self._error

    def close(self, failed: bool = False) -> None:
        """Nothing to end: the connection is the rebuilder's."""


class _ProcessWriter:
    """`_Writer`'s part for a SQLite file: one batch's writes in flight in the writer process
    (`sqlite_writer`), its error handed back as SQLAlchemy's (a unique violation as
    IntegrityError), as from a statement run here. The process checkpoints the WAL when it
    has nothing else to do, and once more, truncating it, at `close`."""

    def __init__(self, path: str, dialect) -> None:
        self._dialect = dialect
        self._process = SqliteWriter(path)
        self._batch = None
        self._in_flight = False

    def writes(self) -> DeferredWrites:
        return DeferredWrites(self._dialect)

    def start(self, writes: DeferredWrites, batch) -> None:
        self._process.send(writes.statements())
        self._batch, self._in_flight = batch, True

    def wait(self) -> Optional[tuple[Any, Optional[BaseException]]]:
        if not self._in_flight:
            return None
        self._in_flight = False
        failure = self._process.receive()
        if failure is None:
            return self._batch, None
        name, message = failure
        cause = getattr(sqlite3, name, sqlite3.Error)(message)
        return self._batch, DBAPIError.instance(
            "a rebuild's batch of writes", None, cause, sqlite3.Error, dialect=self._dialect
        )

    def close(self, failed: bool = False) -> None:
        """Checkpoint and end the process; after a failure (said already) only end it."""
        if failed or self._process.broken:
            self._process.abort()
        else:
            self._process.finish()


class Rebuilder:
    def __init__(self, store, keep: int = KEEP) -> None:
        self.store = store
        self.keep = keep
        with store.engine.connect() as conn:
            fresh = conn.execute(select(func.count()).select_from(t.events)).scalar() == 0
        # A fresh Rows reads nothing: each batch's transaction gives it its `conn` (`_fold_batch`).
        self._rows: Optional[Rows] = Rows(cast(Connection, None), fresh=True) if fresh else None
        self._known: Optional[set[str]] = set() if fresh else None  # ids stored, while fresh
        self._froze = False
        self._collecting: Optional[bool] = None  # whether the collector was on before the first batch
        self._conn = None  # the rebuild's own connection (PostgreSQL, SQLite in memory)
        self._writer = None  # what sends a batch's writes behind the next fold (`_writer_behind`)

    def _connection(self):
        if self._conn is None:
            self._conn = self.store.engine.connect()
        return self._conn

    def _writer_behind(self):
        """`_Writer` (PostgreSQL), `_ProcessWriter` (a SQLite file), or None: written here."""
        if self._writer is None:
            engine = self.store.engine
            if engine.dialect.name == "postgresql":
                self._writer = _Writer(self._connection())
            elif engine.dialect.name == "sqlite" and engine.url.database not in (None, "", ":memory:"):
                self._writer = _ProcessWriter(engine.url.database, engine.dialect)
        return self._writer

    @property
    def fresh(self) -> bool:
        """Whether batches still fold through the rows kept (the target held nothing else)."""
        return self._rows is not None

    def append(self, events: list[tuple[Event, Optional[Dedup]]], packed: Optional[list] = None) -> int:
        """Append `events` in one transaction; how many were new. `packed`: per event its
        (data, claim) as the source stored it, or None to encode it here. The transaction may
        still be in flight on return (see `_Writer`); the next call, `settle` and `close`
        wait for it."""
        if not self.fresh:
            return self.settle() + self.store.append_batch(events)
        if self._collecting is None:
            self._collecting = gc.isenabled()
            gc.disable()
        items = [(event, None, dedup) for event, dedup in events]
        if packed is not None:  # a claim-checked payload lives in the source's blob store: encoded again into ours
            packed = [pair if pair is not None and pair[1] is None else None for pair in packed]
        writer = self._writer_behind()
        if writer is not None:
            return self._append_behind(writer, events, items, packed)
        conn = self._connection()
        try:
            with conn.begin():
                outcomes, finished, _runs = self.store._fold_batch(
                    conn, items, True, rows=self._rows, known=self._known, packed=packed
                )
        except IntegrityError:
            # Someone else wrote into the target: what this Rows holds may no longer be all
            # there is. Start over on the live path for this batch and the rest.
            self._drop()
            return self.store.append_batch(events)
        except BaseException:
            self._drop()  # the transaction rolled back: what the Rows holds was never written
            raise
        self.store.finished.put_many(finished)
        self._after_batch()
        return sum(outcome.stored for outcome in outcomes)

    def _append_behind(self, writer, events, items, packed) -> int:
        """Fold the batch here, then hand its writes to the writer once the batch before has
        committed, and return while they are written (see `_Writer`)."""
        writes = writer.writes()
        try:
            outcomes, finished, _runs = self.store._fold_batch(
                writes, items, True, rows=self._rows, known=self._known, packed=packed
            )
        except BaseException:
            self._settle_quietly()
            self._drop()  # nothing of this batch was written
            raise
        stored = sum(outcome.stored for outcome in outcomes)
        correction = self.settle()
        if not self.fresh:  # the batch before could not be written as folded: this fold assumed it was
            return correction + self.store.append_batch(events)
        writer.start(writes, (events, finished, stored))
        self._after_batch()
        return correction + stored

    def settle(self) -> int:
        """Wait for the batch in flight. If a row another writer stored first made it fail,
        it is appended again on the live path, the rows kept are dropped, and the difference
        in new events against what `append` said is returned; any other failure is raised."""
        done = self._writer.wait() if self._writer is not None else None
        if done is None:
            return 0
        (events, finished, stored), error = done
        if error is None:
            self.store.finished.put_many(finished)
            return 0
        self._drop()
        if isinstance(error, IntegrityError):
            return self.store.append_batch(events) - stored
        raise error

    def _settle_quietly(self) -> None:
        try:
            self.settle()
        except Exception:
            pass  # the caller is already raising its own error

    def _after_batch(self) -> None:
        if (
            self._rows is not None
            and self._known is not None
            and (  # (both kept while fresh)
                self._rows.known() > self.keep or len(self._known) > self.keep
            )
        ):
            self._drop()
        gc.freeze()
        self._froze = True

    def close(self) -> None:
        """Wait for the batch in flight, end the writer (a SQLite file's checkpoints its WAL
        once), and hand what the batches froze back to the garbage collector."""
        failed = True
        try:
            self.settle()
            failed = False
        finally:
            self._release(failed)

    def _release(self, failed: bool) -> None:
        try:
            if self._writer is not None:
                self._writer.close(failed)
                self._writer = None
        finally:
            if self._conn is not None:
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
