"""The unit of work's reads in driver SQL: rows by primary key, and several reads sent at once.

`_Reader` reads a table's rows by key as SQL built once per dialect, table and key count,
on the transaction's own DBAPI connection, each value through its column type's result
processor, so a row reads exactly as SQLAlchemy Core would read it; `LazyRow` defers that
processing to the columns asked for. `driver_rows` is the one place the store's reads go
past SQLAlchemy (tests watch reads there), and `driver_rows_many` sends a pipelined
PostgreSQL transaction's reads before awaiting the first answer (`pg_round_trips`); when it
cannot, each read goes through `driver_rows`. Driver errors come out as SQLAlchemy's.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

from sqlalchemy.engine import Connection
from sqlalchemy.exc import ResourceClosedError

from eventing.store import pg_round_trips
from eventing.store.driver_errors import sqlalchemy_error
from eventing.store.row_tables import _PRIMARY, TABLES, Key, Row


class _Reader:
    """A table's rows by primary key, as driver SQL built once per dialect, table and key
    count, run on the transaction's own DBAPI connection. Through SQLAlchemy Core a point
    read cost about 60 us of Python here (the statement cache's lookup, the IN list's
    expansion, the result's bookkeeping) against 6 us in the driver, and a unit of work makes
    four or five of them a transaction: every gateway append and every projector poll. The
    values go through each column type's own result processor, so a row reads as Core reads it."""

    def __init__(self, dialect, table: str) -> None:
        source = TABLES[table]
        prepare = dialect.identifier_preparer
        self.dialect = dialect
        self.types = [column.type.dialect_impl(dialect) for column in source.columns]
        self.columns = [column.name for column in source.columns]
        # Made from the first result's description: a processor may depend on the type the
        # driver reports (psycopg's float columns).
        self.processors: Optional[list] = None
        self.by_name: dict[str, Any] = {}
        self.head = (
            f"SELECT {', '.join(prepare.quote(c) for c in self.columns)} FROM {prepare.format_table(source)} WHERE "
        )
        self.mark = driver_mark(dialect)
        self.primary = [prepare.quote(c) for c in _PRIMARY[table]]
        # On SQLite a composite key is matched as `(a = ? AND b = ?) OR ...`, which it plans
        # as one primary-key search per key (MULTI-INDEX OR). Its row-value forms do not:
        # `(a, b) IN (VALUES ...)` scanned the whole table, and `IN (SELECT * FROM (VALUES
        # ...))` searched by the first column only (SQLite 3.40; 8 keys of 50,000 rows: 5.4 ms
        # against 12 us), while the submissions, run_steps and checkpoints tables grow with
        # every request.
        self.ored_keys = dialect.name == "sqlite"
        self._sql: dict[int, str] = {}

    def by_keys(self, conn: Connection, keys: list[Key]) -> list[Row]:
        return self.rows(*driver_rows(conn, *self.query(keys)))

    def query(self, keys: list[Key]) -> tuple[str, list]:
        """The driver SQL and parameters that read `keys`' rows."""
        sql = self._sql.get(len(keys))
        if sql is None:
            sql = self._sql[len(keys)] = self.head + self._match(len(keys))
        return sql, [value for key in keys for value in key]

    def lazy(self, conn: Connection, key: Key) -> Optional["LazyRow"]:
        """The row of `key` with each value processed only when asked for (None: absent)."""
        raw, description = driver_rows(conn, *self.query([key]))
        if not raw:
            return None
        self._processors(description)
        return LazyRow(dict(zip(self.columns, raw[0])), self.by_name)

    def _match(self, count: int) -> str:
        if len(self.primary) == 1:
            return f"{self.primary[0]} IN ({', '.join([self.mark] * count)})"
        if self.ored_keys:
            return " OR ".join([f"({' AND '.join(f'{column} = {self.mark}' for column in self.primary)})"] * count)
        one = f"({', '.join([self.mark] * len(self.primary))})"
        return f"({', '.join(self.primary)}) IN ({', '.join([one] * count)})"

    def _processors(self, description) -> list:
        """(column index, processor) for the columns that have one; `by_name` the same by name."""
        if self.processors is None:
            codes = [column[1] for column in description]
            self.processors = [
                (i, process) for i, (kind, code) in enumerate(zip(self.types, codes))
                if (process := kind.result_processor(self.dialect, code)) is not None
            ]  # fmt: skip
            self.by_name = {self.columns[i]: process for i, process in self.processors}
        return self.processors

    def rows(self, raw: Sequence[Any], description) -> list[Row]:
        """Rows of this table's columns, in its order, as the driver gave them with `description`."""
        processors = self._processors(description)
        found = []
        for values in raw:
            values = list(values)
            for i, process in processors:
                values[i] = process(values[i])
            found.append(dict(zip(self.columns, values)))
        return found


class LazyRow:
    """A row read by key with its columns as attributes, as on SQLAlchemy's Row, each value
    through its result processor the first time it is asked for: a request's lookup of its
    run reads a few columns, and decoding the JSON ones it never reads was a tenth of a
    gateway thread's work per future."""

    __slots__ = ("_raw", "_process", "_values")

    def __init__(self, raw: dict[str, Any], process: dict[str, Any]) -> None:
        self._raw, self._process, self._values = raw, process, {}

    def __getattr__(self, name: str) -> Any:
        values = self._values
        if name in values:
            return values[name]
        try:
            value = self._raw[name]
        except KeyError:
            raise AttributeError(name) from None
        process = self._process.get(name)
        values[name] = value = process(value) if process is not None else value
        return value

    @property
    def _mapping(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._raw}

    def __repr__(self) -> str:
        return f"LazyRow({self._mapping!r})"


@functools.lru_cache(maxsize=256)
def _driver_sql(dialect, statement):
    """A select compiled once for `dialect`, to run in driver SQL: (its SQL, the order of its
    positional parameters or None for named ones, the compiled form whose `construct_params`
    adds the statement's own values, such as a LIMIT's, to the caller's)."""
    compiled = statement.compile(dialect=dialect)
    return compiled.string, list(compiled.positiontup) if compiled.positiontup is not None else None, compiled


@functools.lru_cache(maxsize=64)
def _reader(dialect, table: str) -> _Reader:
    return _Reader(dialect, table)


def read_by_key(conn: Connection, table: str, key: Key) -> Optional[LazyRow]:
    """One row of `table` by its whole primary key, read as the unit of work reads, its
    values processed as they are asked for (None: absent)."""
    return _reader(conn.dialect, table).lazy(conn, key)


def driver_mark(dialect) -> str:
    """The driver's positional parameter marker, for SQL written here: sqlite3's `?`, psycopg's `%s`."""
    return "?" if dialect.paramstyle == "qmark" else "%s"


def driver_rows(conn: Connection, sql: str, params) -> tuple[Sequence[Any], Any]:
    """A read in driver SQL on `conn`'s transaction: its rows as the driver gives them, and
    the cursor's description (the one place the store's reads go past SQLAlchemy, so tests
    can watch them here)."""
    raw = conn.connection.dbapi_connection
    if raw is None:  # only once the connection was closed or invalidated
        raise ResourceClosedError("the connection is closed")
    cursor = raw.cursor()
    try:
        cursor.execute(sql, params)
        return cursor.fetchall(), cursor.description
    except conn.dialect.loaded_dbapi.Error as exc:
        raise sqlalchemy_error(conn, exc, sql, params) from exc
    finally:
        cursor.close()


def sent_together(conn: Connection, queries: list) -> bool:
    """Whether `driver_rows_many` sends `queries` at once (else each goes by `driver_rows`)."""
    return len(queries) > 1 and conn.dialect.name == "postgresql" and pg_round_trips.in_pipeline(conn)


def driver_rows_many(conn: Connection, queries: list[tuple[str, Any]]) -> list[tuple[Sequence[Any], Any]]:
    """`driver_rows` of each (sql, params), in order. On a pipelined PostgreSQL transaction
    (`pg_round_trips`) every query is sent before the first answer is awaited: one round
    trip for all of them instead of one each."""
    if not sent_together(conn, queries):
        return [driver_rows(conn, sql, params) for sql, params in queries]
    raw = conn.connection.dbapi_connection
    if raw is None:  # only once the connection was closed or invalidated
        raise ResourceClosedError("the connection is closed")
    cursors = []
    try:
        for sql, params in queries:
            cursors.append(raw.cursor())
            cursors[-1].execute(sql, params)
        return [(cursor.fetchall(), cursor.description) for cursor in cursors]
    except conn.dialect.loaded_dbapi.Error as exc:
        raise sqlalchemy_error(conn, exc) from exc
    finally:
        for cursor in cursors:
            cursor.close()
