"""Driver errors from statements run past SQLAlchemy, raised as SQLAlchemy raises its own.

The store's hot reads and writes go to the driver directly (`unit_of_work`: SQLAlchemy's
per-statement Python cost more than the queries), and PostgreSQL's pipelined transactions
surface their statements' errors at a sync (`pg_round_trips`). Callers still see what
SQLAlchemy would have raised, and a dropped connection handled as SQLAlchemy handles it.
"""

from __future__ import annotations

from typing import Optional

from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, StatementError


def sqlalchemy_error(conn: Connection, exc: Exception, sql: Optional[str] = None, params=None) -> StatementError:
    """A driver error from a statement run past SQLAlchemy, as SQLAlchemy raises it from its
    own (IntegrityError for a unique violation, OperationalError for a lost server, ...). A
    connection the server dropped is invalidated, with every connection the pool made before
    it (so the next checkout connects afresh), and the error says so: the gateway answers
    it with a 503 and `Retry-After` (functions/gateway/errors.py)."""
    # SQLAlchemy types a driver's errors as its DBAPIModule protocol's own class, which no
    # driver's error class derives from.
    disconnect = conn.dialect.is_disconnect(exc, conn.connection.dbapi_connection, None)  # pyright: ignore[reportArgumentType]
    if disconnect and not conn.invalidated:
        conn.engine.pool._invalidate(conn.connection, exc)  # SQLAlchemy's own step on a disconnect
        conn.invalidate(exc)
    return DBAPIError.instance(
        sql, params, exc, conn.dialect.loaded_dbapi.Error, connection_invalidated=disconnect, dialect=conn.dialect
    )
