"""Fewer round trips to PostgreSQL on the store's hot paths.

Every future crosses the database several times: the gateway reads the model's run and later
the future, the group-commit writer stores the request and then deletes its outbox row once
the log has it, the projector stores the completion. On 2 cores, with the gateway, projector,
worker, broker and PostgreSQL sharing them, each round trip cost 1-5 ms of wall time under
load (its thread waits for the server, then for a core and the GIL), and a future made about
fifteen (the Kafka + PostgreSQL futures bench, statements counted per thread): per read a
`pool_pre_ping`, a `BEGIN`, the `SELECT` and a `ROLLBACK`; per write transaction a ping, a
`BEGIN`, each read, each write and the `COMMIT`. Here:

- `read_connection`: a point read runs outside a transaction (autocommit), so it is the
  `SELECT` alone. A single statement sees one snapshot either way.
- `pipelined`: a small write transaction runs in libpq's pipeline mode, its `BEGIN` and
  `COMMIT` statements of the pipeline. The reads that depend on nothing go out together
  (`driver_reads.driver_rows_many`) and come back in one round trip, with the `BEGIN`; the
  writes after them are sent without waiting and go with the `COMMIT`. A batch of training
  requests costs the group-commit writer 2 round trips instead of about twelve (the tests
  count them in libpq's trace). A statement's error (a unique violation) surfaces at the
  sync and is raised as SQLAlchemy raises it from the statement (IntegrityError), nothing of
  the transaction stored. COPY is not allowed in pipeline mode, so a batch large enough for
  COPY to pay (`PIPELINE_MOST_ROWS`) is written outside it.
- `install`: a pooled connection is pinged only when it sat unused for `idle_seconds`,
  instead of on every checkout. A connection the server dropped while it was in use fails
  its next statement; it and every connection of the pool made before it are invalidated
  (`driver_errors`), and the caller's error is a 503 with `Retry-After`
  (`functions/gateway/errors.py`) that the SDK retries, as when the database is away.

What it did not buy on a quiet machine: psycopg's pipeline mode costs more Python per
statement than a plain execute, so where the round trips were cheap (nothing else wanting
the cores) the writer's and the projector's CPU per future rose a little and the futures
rate stayed where it was; the gain is under contention, where each wait was long (README.md at 40db992).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from sqlalchemy import event, exc
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import ResourceClosedError

from eventing.store.driver_errors import sqlalchemy_error

# A connection idle this long is pinged before use; one in steady use is not.
IDLE_PING_SECONDS = 1.0

# Above this many rows, a write is one COPY (driver_writes._RowsInsert), which pipeline mode
# does not allow: such a transaction runs outside it.
PIPELINE_MOST_ROWS = 64


@contextlib.contextmanager
def read_connection(engine: Engine) -> Iterator[Connection]:
    """A pooled connection whose statements run without a transaction around them."""
    with engine.connect() as conn:
        yield conn.execution_options(isolation_level="AUTOCOMMIT")


@contextlib.contextmanager
def pipelined(engine: Engine) -> Iterator[Connection]:
    """`engine.begin()` in pipeline mode (module docstring). The connection is in autocommit
    and the block's `BEGIN` and `COMMIT` are statements of the pipeline: psycopg's own
    `BEGIN` would wait for its answer (a round trip of its own) to learn the transaction's
    state. A statement SQLAlchemy runs itself (a `Rows.select`) is synced at once
    (`install`), since SQLAlchemy reads the cursor's description right after executing it."""
    from psycopg.pq import TransactionStatus

    with read_connection(engine) as conn:
        raw = conn.connection.driver_connection
        if raw is None:  # only once the connection was closed or invalidated
            raise ResourceClosedError("the connection is closed")
        try:
            with raw.pipeline() as pipeline:
                conn.info[_PIPELINE] = pipeline
                raw.execute("BEGIN")
                yield conn
                raw.execute("COMMIT")
        except conn.dialect.loaded_dbapi.Error as error:  # psycopg's, from a sync: as SQLAlchemy raises it
            raise sqlalchemy_error(conn, error) from error
        finally:
            conn.info.pop(_PIPELINE, None)
            if not raw.closed and raw.info.transaction_status != TransactionStatus.IDLE:
                raw.rollback()  # the block raised, or a statement failed and the COMMIT was skipped


_PIPELINE = "openrl_pipeline"


def in_pipeline(conn: Connection) -> bool:
    """Whether `conn`'s driver connection is in pipeline mode (no COPY there)."""
    raw = conn.connection.driver_connection
    return raw is not None and bool(raw.pgconn.pipeline_status)  # (a closed one has no pipeline)


def install(engine: Engine, idle_seconds: float = IDLE_PING_SECONDS) -> None:
    """On a PostgreSQL engine: a ping only for a connection idle `idle_seconds`, in place of
    `pool_pre_ping` (module docstring); a failed ping raises DisconnectionError, on which the
    pool drops the connection and checks out another. And inside `pipelined`, a statement
    SQLAlchemy ran is synced before SQLAlchemy looks at its result."""

    @event.listens_for(engine, "connect")
    def _made(_dbapi_connection, record) -> None:
        record.info[_USED] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_connection, record, _proxy) -> None:
        if time.monotonic() - record.info.get(_USED, 0.0) < idle_seconds:
            return
        try:
            _ping(dbapi_connection)
        except Exception as error:  # a closed socket, a server gone: any failure means a new connection
            raise exc.DisconnectionError(f"ping failed: {error}") from error
        record.info[_USED] = time.monotonic()

    @event.listens_for(engine, "checkin")
    def _checkin(_dbapi_connection, record) -> None:
        if record is not None:
            record.info[_USED] = time.monotonic()

    @event.listens_for(engine, "after_cursor_execute")
    def _sync_for_sqlalchemy(conn, _cursor, _statement, _parameters, _context, _executemany) -> None:
        pipeline = conn.info.get(_PIPELINE)
        if pipeline is not None:
            pipeline.sync()


_USED = "openrl_used"  # when the connection was last checked in (or made)


def _ping(dbapi_connection) -> None:
    """An empty statement outside a transaction: SQLAlchemy's own ping would begin one (a
    `BEGIN` round trip too) and leave it open for the caller."""
    was = dbapi_connection.autocommit
    dbapi_connection.autocommit = True
    try:
        dbapi_connection.execute(";")
    finally:
        dbapi_connection.autocommit = was
