"""The unit of work's writes in driver SQL: executemany in one driver call, COPY on
PostgreSQL, and writes deferred to another connection.

`execute_many` is `conn.execute(statement, rows)` for a write with bind parameters: compiled
once per (statement, dialect, keys) (`_Compiled`), each parameter through its column type's
own bind processor, so the driver is sent exactly what SQLAlchemy would send; on PostgreSQL
a batch of inserts outside pipeline mode is one COPY (`_RowsInsert`), which stores what the
INSERT would. `DeferredWrites` records a write-only transaction's statements to run later
on another (thread's) connection. Invariants: driver errors come out as SQLAlchemy's (a
unique violation as IntegrityError), and the transaction's rollback stays the caller's.
"""

from __future__ import annotations

import operator
from datetime import datetime
from typing import Any, Optional

from sqlalchemy.dialects.sqlite import DATETIME as SQLITE_DATETIME
from sqlalchemy.engine import Connection
from sqlalchemy.exc import ResourceClosedError
from sqlalchemy.sql.dml import Insert

from eventing.store import pg_round_trips
from eventing.store.driver_errors import sqlalchemy_error


class _Compiled:
    """A write statement compiled once per dialect, for `executemany`: each parameter goes
    through its column type's own bind processor (what SQLAlchemy would send), and the rows
    go to the driver in one call. SQLAlchemy's own executemany spent about 20 us per row on
    its generic parameter handling, more than the database took to write it."""

    def __init__(self, statement, dialect, keys: tuple[str, ...]) -> None:
        compiled = statement.compile(dialect=dialect, column_keys=list(keys))
        self.sql = compiled.string
        processors = {name: _bind_processor(bind.type, dialect) for name, bind in compiled.binds.items()}
        self.positional = compiled.positiontup is not None
        names = list(compiled.positiontup) if self.positional else list(compiled.binds)
        self.order = [(name, processors.get(name)) for name in names]
        self.rows_insert = _RowsInsert.of(statement, dialect, keys, processors)
        # A row's values in order by one C call, then only the columns with a processor
        # touched in Python: the per-column loop was most of a batch's parameter work.
        self._values = operator.itemgetter(*names) if len(names) > 1 else (lambda row, _name=names[0]: (row[_name],))
        self._processed = [(i, process) for i, (_name, process) in enumerate(self.order) if process is not None]

    def params(self, rows: list[dict]) -> list:
        if not self.positional:
            return [
                {name: process(row[name]) if process else row[name] for name, process in self.order} for row in rows
            ]
        values, processed = self._values, self._processed
        if not processed:
            return [values(row) for row in rows]
        out = []
        for row in rows:
            one = list(values(row))
            for i, process in processed:
                one[i] = process(one[i])
            out.append(one)
        return out


def _bind_processor(type_, dialect):
    """The column type's bind processor, except SQLite's for datetimes in its default text
    form: SQLAlchemy's formats a dict of seven fields per value in Python, and a replay
    binds every event's time and several of each projection's row (about a twentieth of its
    fold); `isoformat` writes the same text in C."""
    impl = type_.dialect_impl(dialect)
    process = impl.bind_processor(dialect)
    if (
        dialect.name != "sqlite"
        or not isinstance(impl, SQLITE_DATETIME)
        or impl._storage_format != SQLITE_DATETIME._storage_format
    ):
        return process

    def sqlite_datetime(value, _exact=datetime, _general=process):
        if type(value) is _exact:  # aware or naive, its own wall clock, as SQLAlchemy stores it
            return value.isoformat(" ", "microseconds")[:26]
        return _general(value)

    return sqlite_datetime


class _RowsInsert:
    """PostgreSQL: an INSERT of many rows as one COPY. psycopg's executemany sends a
    statement per row (pipelined); at a replay's or a busy projector's batch sizes the
    per-statement work, in psycopg's Python and in the server, cost more than the rows.
    (A multi-row VALUES statement was slower still: psycopg parses each new statement's
    placeholders in Python.) The rows' values are the ones the bind processors give, so
    COPY stores what the INSERT would; a unique violation is raised as SQLAlchemy's
    IntegrityError, as from the INSERT, and rolls the transaction back the same way."""

    def __init__(self, copy_sql: str, order: list) -> None:
        self.copy_sql, self.order = copy_sql, order

    @classmethod
    def of(cls, statement, dialect, keys: tuple[str, ...], processors: dict) -> Optional["_RowsInsert"]:
        """For an INSERT on PostgreSQL whose values are exactly `keys`, one bind each (SQLAlchemy
        names an INSERT's binds by column); None for anything else (a column default or a SQL
        expression among the values), which stays an INSERT."""
        if dialect.name != "postgresql" or not isinstance(statement, Insert):
            return None
        table = statement.table
        if set(processors) != set(keys) or not set(keys) <= set(table.c.keys()):
            return None
        quote = dialect.identifier_preparer.quote
        names = [
            column.name for column in table.columns if column.name in keys
        ]  # the table's order, as the INSERT has them
        columns = ", ".join(quote(name) for name in names)
        return cls(
            f"COPY {dialect.identifier_preparer.format_table(table)} ({columns}) FROM STDIN",
            [(name, processors[name]) for name in names],
        )

    def execute(self, conn: Connection, rows: list[dict]) -> None:
        """Row by row into the COPY stream: psycopg sends what it has formatted every 32 KiB,
        so the server works on the first rows while the last are formatted (measured faster
        than formatting all rows first and sending them at once)."""

        def fill(copy) -> None:
            for row in rows:
                copy.write_row(self._values(row))

        _copy(conn, self.copy_sql, fill)

    def format(self, context, rows: list[dict]) -> bytes:
        """The rows as COPY's text format, each value as `context`'s adapters write it: a
        psycopg connection, or its `copy_context`. (psycopg's own formatter, the one its
        `Copy.write_row` runs: it has no public name yet.)"""
        from psycopg._copy_base import TextFormatter
        from psycopg.adapt import Transformer

        formatter = TextFormatter(Transformer(context))
        chunks = [formatter.write_row(self._values(row)) for row in rows]
        chunks.append(formatter.end())
        return b"".join(chunks)

    def _values(self, row: dict) -> list:
        """A row's values in COPY's column order, each through its column's bind processor."""
        return [process(row[name]) if process else row[name] for name, process in self.order]

    @staticmethod
    def send(conn: Connection, copy_sql: str, data: bytes) -> None:
        """Rows `format` made, in one COPY."""
        _copy(conn, copy_sql, lambda copy: copy.write(data))


def _copy(conn: Connection, copy_sql: str, fill) -> None:
    """`fill(copy)` writes a COPY FROM STDIN's data; psycopg's errors come out as SQLAlchemy's
    (a unique violation as IntegrityError), as from a statement run through `conn`."""
    import psycopg  # only reached on PostgreSQL, whose driver this is

    raw = conn.connection.driver_connection
    if raw is None:  # only once the connection was closed or invalidated
        raise ResourceClosedError("the connection is closed")
    try:
        with raw.cursor() as cursor, cursor.copy(copy_sql) as copy:
            fill(copy)
    except psycopg.Error as exc:
        raise sqlalchemy_error(conn, exc, copy_sql) from exc


class _CopyContext:
    """A psycopg adaptation context with a connection's adapters but not the connection, for
    formatting COPY rows on one thread while another uses the connection (libpq's
    connection object is not to be shared between threads): text is then encoded as UTF-8,
    so the connection must use that client encoding."""

    def __init__(self, adapters) -> None:
        self.adapters = adapters
        self.connection = None


def copy_context(conn: Connection) -> _CopyContext:
    """For `DeferredWrites` on PostgreSQL: sets `conn`'s client encoding to UTF-8 if it is
    another, and returns a context that formats rows without touching `conn`."""
    raw = conn.connection.driver_connection
    if raw is None:  # only once the connection was closed or invalidated
        raise ResourceClosedError("the connection is closed")
    if raw.info.encoding != "utf-8":
        conn.exec_driver_sql("SET client_encoding TO 'UTF8'")
        conn.commit()
    return _CopyContext(raw.adapters)


_COMPILED: dict[tuple, _Compiled] = {}


def _compiled(dialect, statement, rows: list[dict]) -> _Compiled:
    keys = tuple(rows[0])
    cache_key = (id(statement), dialect.name, keys)
    compiled = _COMPILED.get(cache_key)
    if compiled is None:
        compiled = _COMPILED[cache_key] = _Compiled(statement, dialect, keys)
    return compiled


class DeferredWrites:
    """Stands in for the connection of a transaction that only writes (a rebuild into an
    empty store reads nothing back): `execute_many` records each write, with its parameters
    processed and, for a PostgreSQL COPY, its rows already formatted, so the rows may change
    afterwards; `run(conn)` then sends them all, in order, on a real connection, which can
    be another thread's: what is left there is the database's work, with the GIL released
    while the driver waits on it."""

    def __init__(self, dialect, formatting=None) -> None:
        self.dialect = dialect
        self._formatting = formatting  # PostgreSQL: what formats COPY rows (`copy_context`)
        self._writes: list[tuple[str, str, Any]] = []  # (kind, sql, params or COPY data)

    def add(self, statement, rows: list[dict]) -> None:
        compiled = _compiled(self.dialect, statement, rows)
        if compiled.rows_insert is not None and self._formatting is not None:
            self._writes.append(
                ("copy", compiled.rows_insert.copy_sql, compiled.rows_insert.format(self._formatting, rows))
            )
        else:
            self._writes.append(("sql", compiled.sql, compiled.params(rows)))

    def execute(self, *_args, **_kwargs):
        raise RuntimeError("deferred writes: this transaction was to read nothing")

    def statements(self) -> list[tuple[str, list]]:
        """The writes as (driver SQL, its rows of processed parameters), for a writer in
        another process (`sqlite_writer`); only without COPY data."""
        if any(kind != "sql" for kind, _sql, _params in self._writes):
            raise ValueError("COPY data is sent on the connection it was formatted for")
        return [(sql, params) for _kind, sql, params in self._writes]

    def run(self, conn: Connection) -> None:
        for kind, sql, params in self._writes:
            if kind == "copy":
                _RowsInsert.send(conn, sql, params)
            else:
                conn.exec_driver_sql(sql, params)


def execute_many(conn: Connection, statement, rows: list[dict]) -> None:
    """`conn.execute(statement, rows)` for a write with bind parameters, in one driver call
    (every row with the same keys; an INSERT writes the columns they name)."""
    if not rows:
        return
    if isinstance(conn, DeferredWrites):
        conn.add(statement, rows)
        return
    compiled = _compiled(conn.dialect, statement, rows)
    if compiled.rows_insert is not None and len(rows) > 1 and not pg_round_trips.in_pipeline(conn):
        compiled.rows_insert.execute(conn, rows)  # COPY (not in pipeline mode, where the rows are few)
        return
    driver_execute(conn, compiled.sql, compiled.params(rows))


def driver_execute(conn: Connection, sql: str, params: list) -> None:
    """A write in driver SQL on `conn`'s transaction, once per parameter set: SQLAlchemy's
    `exec_driver_sql` still cost about 25 us of Python a statement around the driver's call,
    and a transaction makes several. The driver's errors come out as SQLAlchemy's (a unique
    violation as IntegrityError), as from a statement run through `conn`, and the
    transaction's rollback is the caller's as ever."""
    raw = conn.connection.dbapi_connection
    if raw is None:  # only once the connection was closed or invalidated
        raise ResourceClosedError("the connection is closed")
    cursor = raw.cursor()
    try:
        if len(params) == 1:
            cursor.execute(sql, params[0])
        else:
            cursor.executemany(sql, params)
    except conn.dialect.loaded_dbapi.Error as exc:
        raise sqlalchemy_error(conn, exc, sql, params) from exc
    finally:
        cursor.close()
