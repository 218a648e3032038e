"""A connection per thread, kept across calls, for a SQLite file store.

Every request's lookup (its run, session or future), every gateway append and every
projector poll took a connection from SQLAlchemy's pool and gave it back: a `Connection`
made, the pool's checkout and check-in, a reset (a rollback) on return. A point read
took 14-15 us that way here and 7.6-7.8 us through `Kept.connect` (README.md at 40db992), and in the no-op
futures bench the event loop's run lookup spent more on the checkout than on the query.
A thread that reads or writes the store over and over (the event loop, the group-commit
writer, the projector) now keeps one connection and uses it again.

Only for a SQLite file: it never drops a connection, so a kept one stays good. PostgreSQL
keeps the pool's checkout, which replaces a connection the server dropped, and saves round
trips instead: its reads run outside a transaction and its small write transactions in
pipeline mode (`pg_round_trips`). An in-memory SQLite store is one connection already.

What keeps it sound:
- a read leaves no transaction open: `connect()` rolls back whatever the caller began, so
  a kept connection never pins an old WAL snapshot (its next read sees every commit since)
  nor holds SQLite's write lock;
- a thread using its kept connection and asking for one again (a read inside its own
  write, say) gets a pooled one: rolling back on the way out would end the outer
  transaction;
- at most `most` threads keep one, so the gateway's many threads cannot take the pool's
  connections away from each other; the rest check out as before;
- `close()` (the runtime's close) closes them all before the engine is disposed.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, ContextManager, Iterator, Optional

from sqlalchemy.engine import Connection, Engine

from eventing.store import pg_round_trips

# The threads that use the store over and over are a handful (event loop, group-commit
# writer, projector, outbox relay, reaper); the gateway's pool threads past these share the pool.
KEPT_MOST = 6

_REGISTRY: "weakref.WeakKeyDictionary[Engine, Kept]" = weakref.WeakKeyDictionary()
_REGISTRY_LOCK = threading.Lock()


class Kept:
    def __init__(self, engine: Engine, most: int = KEPT_MOST) -> None:
        self.engine = engine
        database = engine.url.database
        self.enabled = engine.dialect.name == "sqlite" and bool(database) and database != ":memory:" and most > 0
        self.postgres = engine.dialect.name == "postgresql"
        self.most = most
        self._local = threading.local()
        self._lock = threading.Lock()
        self._kept: list[Connection] = []
        self._closed = False

    def _mine(self) -> Optional[Connection]:
        """This thread's kept connection, made on first use (None: not kept, or in use)."""
        local = self._local
        if getattr(local, "busy", False):
            return None
        conn = getattr(local, "conn", None)
        if conn is not None and not conn.closed and not conn.invalidated:
            return conn
        with self._lock:
            if self._closed or len(self._kept) >= self.most:
                return None
            conn = self.engine.connect()
            self._kept.append(conn)
        local.conn = conn
        return conn

    def connect(self) -> ContextManager[Connection]:
        """A connection for reads; no transaction is left open after it (on PostgreSQL none
        is begun: each statement reads on its own)."""
        if self.postgres:
            return pg_round_trips.read_connection(self.engine)
        return self._use(self.engine.connect, _rolled_back)

    def begin(self, rows: int = 0) -> ContextManager[Connection]:
        """A transaction, committed when the block ends, rolled back if it raises. `rows`:
        about how many rows its largest write has (on PostgreSQL, a small transaction's
        writes are pipelined with its commit; a large one's go by COPY)."""
        if self.postgres and rows <= pg_round_trips.PIPELINE_MOST_ROWS:
            return pg_round_trips.pipelined(self.engine)
        return self._use(self.engine.begin, Connection.begin)

    @contextlib.contextmanager
    def _use(self, pooled: Callable, around: Callable) -> Iterator[Connection]:
        """The thread's kept connection inside `around(conn)`, or `pooled()` when it has none free."""
        conn = self._mine() if self.enabled else None
        if conn is None:
            with pooled() as checked_out:
                yield checked_out
            return
        local = self._local
        local.busy = True
        try:
            with around(conn):
                yield conn
        finally:
            local.busy = False

    def close(self) -> None:
        """Close every kept connection (in use or not: call it when the store's users have stopped)."""
        with self._lock:
            self._closed = True
            kept, self._kept = self._kept, []
        for conn in kept:
            with contextlib.suppress(Exception):
                conn.close()


@contextlib.contextmanager
def _rolled_back(conn: Connection) -> Iterator[None]:
    """Whatever the block began on `conn` ends with it (a read keeps no snapshot, no lock)."""
    try:
        yield
    finally:
        if conn.in_transaction():
            conn.rollback()


def kept(engine: Engine) -> Kept:
    """The engine's kept connections (one registry per engine, shared by its users)."""
    found = _REGISTRY.get(engine)
    if found is None:
        with _REGISTRY_LOCK:
            found = _REGISTRY.get(engine)
            if found is None:
                found = _REGISTRY[engine] = Kept(engine)
    return found


def close_kept(engine: Engine) -> None:
    found = _REGISTRY.get(engine)
    if found is not None:
        found.close()
