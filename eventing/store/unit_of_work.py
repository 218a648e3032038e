"""The projections' unit of work: the rows one transaction reads and writes, batched.

The projections fold events into rows through a `Rows` only. It reads a row from the
database the first time it is asked for (or for a whole batch at once: `prefetch`), keeps it,
and writes back at `flush` only what changed: per table, one executemany of the inserts, one
per set of changed columns of the updates, one of the deletes. A transaction that folds a
hundred events thus costs a handful of statements instead of several per event, which is what
the live path's batches (the gateway's group commit, the projector's poll) and replay's long
batches pay for.

Rows are dicts of every column of their table, with the values the database gives back,
except that datetimes are always UTC-aware (SQLite hands them back naive). A row handed out
is the unit of work's own: change it only through `insert`, `update` and `delete`. An update
writes only the columns it changed, so two processes updating different columns of one row
(the gateway a run's last request time, the projector its state) never undo each other.
"""

from __future__ import annotations

import functools
import operator
from datetime import datetime, timezone
from typing import Any, Iterable, Optional

from sqlalchemy import DateTime, bindparam, delete, insert, select, union_all, update
from sqlalchemy.dialects.sqlite import DATETIME as SQLITE_DATETIME
from sqlalchemy.engine import Connection
from sqlalchemy.sql.dml import Insert

from eventing.store import pg_round_trips
from eventing.store import tables as t
from eventing.store.driver_errors import sqlalchemy_error

Row = dict[str, Any]
Key = tuple

TABLES = {
    table.name: table
    for table in (
        t.sessions,
        t.training_runs,
        t.run_steps,
        t.checkpoints,
        t.sampling_sessions,
        t.futures,
        t.submissions,
        t.lease_fences,
    )
}
_PRIMARY = {name: [c.name for c in table.primary_key.columns] for name, table in TABLES.items()}
_COLUMNS = {name: [c.name for c in table.columns] for name, table in TABLES.items()}
_COLUMN_SETS = {name: frozenset(columns) for name, columns in _COLUMNS.items()}
_DATETIMES = {name: [c.name for c in table.columns if isinstance(c.type, DateTime)] for name, table in TABLES.items()}


def _key_getter(columns: list[str]):
    if len(columns) == 1:
        column = columns[0]
        return lambda row: (row[column],)
    return operator.itemgetter(*columns)  # a tuple already, for two columns or more


_KEY_OF = {name: _key_getter(columns) for name, columns in _PRIMARY.items()}


def key_of(table: str, row: Row) -> Key:
    return _KEY_OF[table](row)


def _matches(row: Row, equal: dict) -> bool:
    return all(row[c] in v if isinstance(v, tuple) else row[c] == v for c, v in equal.items())


def utc(value: Optional[datetime]) -> Optional[datetime]:
    """SQLite hands datetimes back naive; everything stored here is UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=timezone.utc)


class _Statements:
    """Each table's statements, built once with bind parameters (building one per call cost
    more than running it)."""

    def __init__(self) -> None:
        self.insert, self.delete, self._updates = {}, {}, {}
        for name, table in TABLES.items():
            columns = [table.c[c] for c in _PRIMARY[name]]
            self.insert[name] = insert(table)
            self.delete[name] = delete(table).where(*(c == bindparam("b_" + c.name) for c in columns))

    def update(self, name: str, changed: frozenset[str]):
        statement = self._updates.get((name, changed))
        if statement is None:
            table = TABLES[name]
            statement = (
                update(table)
                .where(*(table.c[c] == bindparam("b_" + c) for c in _PRIMARY[name]))
                .values({c: bindparam("v_" + c) for c in sorted(changed)})
            )
            self._updates[(name, changed)] = statement
        return statement


_STATEMENTS = _Statements()


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

    def rows(self, raw: list[tuple], description) -> list[Row]:
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


def primary_key(table: str) -> list[str]:
    return list(_PRIMARY[table])


def driver_mark(dialect) -> str:
    """The driver's positional parameter marker, for SQL written here: sqlite3's `?`, psycopg's `%s`."""
    return "?" if dialect.paramstyle == "qmark" else "%s"


def driver_rows(conn: Connection, sql: str, params) -> tuple[list[tuple], Any]:
    """A read in driver SQL on `conn`'s transaction: its rows as the driver gives them, and
    the cursor's description (the one place the store's reads go past SQLAlchemy, so tests
    can watch them here)."""
    cursor = conn.connection.dbapi_connection.cursor()
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


def driver_rows_many(conn: Connection, queries: list[tuple[str, Any]]) -> list[tuple[list[tuple], Any]]:
    """`driver_rows` of each (sql, params), in order. On a pipelined PostgreSQL transaction
    (`pg_round_trips`) every query is sent before the first answer is awaited: one round
    trip for all of them instead of one each."""
    if not sent_together(conn, queries):
        return [driver_rows(conn, sql, params) for sql, params in queries]
    raw = conn.connection.dbapi_connection
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

    try:
        with conn.connection.driver_connection.cursor() as cursor, cursor.copy(copy_sql) as copy:
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
        self._writes: list[tuple[str, str, object]] = []  # (kind, sql, params or COPY data)

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
    cursor = conn.connection.dbapi_connection.cursor()
    try:
        if len(params) == 1:
            cursor.execute(sql, params[0])
        else:
            cursor.executemany(sql, params)
    except conn.dialect.loaded_dbapi.Error as exc:
        raise sqlalchemy_error(conn, exc, sql, params) from exc
    finally:
        cursor.close()


@functools.lru_cache(maxsize=256)
def _top_rows(table: str, column: str, group: str, count: int):
    """The top row (greatest `column`) of each of `count` groups, one query built once per
    count with bind parameters b_group_0..: per group a part that walks the primary key
    backwards to its first row, glued with UNION ALL. (A GROUP BY max() over the groups read
    every row of each group: a long run's steps, on every training completion.)"""
    source = TABLES[table]
    parts = [
        select(source)
        .where(source.c[group] == bindparam(f"b_group_{i}"))
        .order_by(source.c[column].desc())
        .limit(1)
        .subquery()
        for i in range(count)
    ]
    return union_all(*(select(part) for part in parts)) if count > 1 else select(parts[0])


class Rows:
    """The rows of one transaction on `conn` (see the module docstring)."""

    def __init__(self, conn: Connection, fresh: bool = False) -> None:
        self.conn = conn
        # Fresh: the database holds only rows this Rows wrote (a replay into an empty store
        # keeps one Rows across its transactions), so a key it does not know is absent and
        # no read goes to the database.
        self.fresh = fresh
        self._rows: dict[str, dict[Key, Optional[Row]]] = {name: {} for name in TABLES}  # None: known absent
        self._stored: dict[str, set[Key]] = {name: set() for name in TABLES}  # keys the database holds
        self._changed: dict[str, dict[Key, set[str]]] = {name: {} for name in TABLES}
        # `latest` answers, kept current as rows become known or change: table -> (order
        # column, group column) -> group value -> key of the top row (None: no row). A run's
        # step asks for its latest step on every training completion.
        self._tops: dict[str, dict[tuple[str, str], dict[Any, Optional[Key]]]] = {name: {} for name in TABLES}
        self._indexed: set[tuple[str, str, str]] = (
            set()
        )  # (table, column, group) whose `_tops` hold every group (fresh only)

    # -- reading ------------------------------------------------------------------------------

    def get(self, table: str, *key) -> Optional[Row]:
        cache = self._rows[table]
        if key not in cache:
            self.prefetch(table, [key])
        return cache[key]

    def prefetch(self, table: str, keys: Iterable[Key]) -> None:
        """Read every row of `keys` not yet known, in one query."""
        self.prefetch_many([(table, keys)])

    def prefetch_many(self, wanted: list[tuple[str, Iterable[Key]]], also: list[tuple[str, Any]] = ()) -> list:
        """`prefetch` of several tables, their queries sent together (`driver_rows_many`);
        `also`: more (sql, params) reads to send with them, whose (rows, description) it
        returns, in order."""
        plan, queries = [], []
        for table, keys in wanted:
            cache = self._rows[table]
            keys = list({key for key in keys if key not in cache})
            if not keys:
                continue
            if self.fresh:
                for key in keys:
                    cache[key] = None
                continue
            reader = _reader(self.conn.dialect, table)
            for start in range(0, len(keys), 500):  # bounded IN lists
                chunk = keys[start : start + 500]
                plan.append((table, chunk, reader))
                queries.append(reader.query(chunk))
        answers = driver_rows_many(self.conn, list(also) + queries)
        for (table, chunk, reader), raw in zip(plan, answers[len(also) :]):
            for row in reader.rows(*raw):
                self._remember(table, row)
            cache = self._rows[table]
            for key in chunk:
                cache.setdefault(key, None)
        return answers[: len(also)]

    def select(self, table: str, **equal) -> list[Row]:
        """Every row whose columns equal `equal` (a tuple value: any of its values); a
        secondary lookup, not one for every event."""
        source = TABLES[table]
        where = [source.c[c].in_(v) if isinstance(v, tuple) else source.c[c] == v for c, v in equal.items()]
        if not self.fresh:
            for row in self.conn.execute(select(source).where(*where)):
                self._remember(table, row)
        return [row for row in self._rows[table].values() if row is not None and _matches(row, equal)]

    def latest(self, table: str, column: str, group: str, value: Any) -> Optional[Row]:
        """The row whose `group` column equals `value` with the greatest `column` (a run's
        last step). Rows of such a group are never deleted (run_steps are not)."""
        tops = self._tops[table].setdefault((column, group), {})
        if value not in tops:
            self.prefetch_latest(table, column, group, [value])
        key = tops.get(value)
        return self._rows[table][key] if key is not None else None

    def prefetch_latest(self, table: str, column: str, group: str, values: Iterable[Any]) -> None:
        """`latest` for many groups at once: one query for the top row of each."""
        tops = self._tops[table].setdefault((column, group), {})
        pending = sorted({v for v in values if v not in tops})
        if not pending:
            return
        if self.fresh:
            self._index_tops(table, column, group, tops)
            for value in pending:
                tops.setdefault(value, None)  # every row is known here: a group not indexed has none
            return
        query = _top_rows(table, column, group, len(pending))
        for value in pending:  # rows this transaction already knows count too
            tops[value] = max(
                (key for key, row in self._rows[table].items() if row is not None and row[group] == value),
                key=lambda key: self._rows[table][key][column], default=None,
            )  # fmt: skip
        sql, names, compiled = _driver_sql(self.conn.dialect, query)
        params = compiled.construct_params({f"b_group_{i}": value for i, value in enumerate(pending)})
        raw = driver_rows(self.conn, sql, tuple(params[name] for name in names) if names is not None else params)
        for row in _reader(self.conn.dialect, table).rows(*raw):
            self._remember(table, row)

    def _index_tops(self, table: str, column: str, group: str, tops: dict) -> None:
        """A fresh Rows, the first time it is asked for a (column, group)'s latest: the top
        row of every group it holds, found in one pass, and from then on `_track` keeps every
        group's answer, new groups too. (Asked group by group, as a rebuild's first step of
        each run asks, a pass per group over a long history's steps grew with the runs times
        the steps: about a tenth of a 100,000-event rebuild.)"""
        index = (table, column, group)
        if index in self._indexed:
            return
        self._indexed.add(index)
        cache = self._rows[table]
        for key, row in cache.items():
            if row is not None:
                current = tops.get(row[group])
                if current is None or cache[current][column] <= row[column]:
                    tops[row[group]] = key

    def known(self) -> int:
        """How many rows (and known absences) this Rows holds."""
        return sum(len(cache) for cache in self._rows.values())

    def _track(self, table: str, key: Key, row: Row) -> None:
        """Keep the `latest` answers right as `row` becomes known or changes."""
        for (column, group), tops in self._tops[table].items():
            value = row[group]
            if value in tops:
                current = tops[value]
                if current is None or self._rows[table][current][column] <= row[column]:
                    tops[value] = key
            elif (table, column, group) in self._indexed:  # every group's answer is kept: this one's first row
                tops[value] = key

    def _remember(self, table: str, record) -> None:
        """`record`: a row as a dict, or as SQLAlchemy gives it."""
        row = dict(record) if isinstance(record, dict) else dict(record._mapping)
        for column in _DATETIMES[table]:
            row[column] = utc(row[column])
        key = key_of(table, row)
        self._stored[table].add(key)
        if (
            self._rows[table].get(key) is None and key not in self._changed[table]
        ):  # what this transaction changed wins over a re-read
            self._rows[table][key] = row
            self._track(table, key, row)

    # -- writing ------------------------------------------------------------------------------

    def insert(self, table: str, *, fresh: bool = False, **values) -> Row:
        """Insert (or replace) a whole row; columns not given are None. `fresh`: the caller
        knows no such row is stored (a step number one past the latest), so none is read."""
        unknown = values.keys() - _COLUMN_SETS[table]
        if unknown:
            raise KeyError(f"{table} has no columns {sorted(unknown)}")
        row = dict.fromkeys(_COLUMNS[table])
        row.update(values)
        key = _KEY_OF[table](row)
        cache = self._rows[table]
        if key not in cache and not fresh and not self.fresh:  # (a fresh Rows knows every stored row)
            self.prefetch(table, [key])  # whether the database holds it decides insert or update
        cache[key] = row
        self._changed[table][key] = _COLUMN_SETS[table]  # every column: shared, never added to (see `update`)
        self._track(table, key, row)
        return row

    def update(self, table: str, key: Key, **values) -> Optional[Row]:
        """Change some columns of a row; None (and nothing changed) when there is no such row."""
        row = self.get(table, *key)
        if row is None:
            return None
        changes = self._changed[table]
        changed = changes.get(key)
        if changed is None:
            changed = changes[key] = set()
        every = changed is _COLUMN_SETS[table]  # inserted whole: every column is written already
        for column, value in values.items():
            if column not in row:
                raise KeyError(f"{table} has no column {column!r}")
            if row[column] != value or type(row[column]) is not type(value):  # 1 == 1.0 == True, yet not the same value
                row[column] = value
                if not every:
                    changed.add(column)
        if changed:
            self._track(table, key, row)
        return row

    def delete(self, table: str, key: Key) -> None:
        if self.get(table, *key) is not None:
            self._rows[table][key] = None
            self._changed[table][key] = set()

    def changed(self, table: str) -> list[Row]:
        """The rows of `table` this transaction inserted or changed (before `flush`)."""
        return [row for key in self._changed[table] if (row := self._rows[table][key]) is not None]

    def changed_keys(self, table: str, ignoring: frozenset[str] = frozenset()) -> list[Key]:
        """The keys of `table` this transaction inserted, deleted or changed in a column not
        in `ignoring` (before `flush`)."""
        return [key for key, columns in self._changed[table].items() if not columns or not columns <= ignoring]

    def flush(self) -> None:
        """Write back every change: inserts, updates by changed columns, deletes."""
        for table in TABLES:
            inserts, deletes, updates = [], [], {}
            for key, changed in self._changed[table].items():
                row, stored = self._rows[table][key], key in self._stored[table]
                if row is None:
                    if stored:
                        deletes.append({"b_" + c: v for c, v in zip(_PRIMARY[table], key)})
                elif not stored:
                    inserts.append(row)
                elif changed:
                    columns = frozenset(changed - set(_PRIMARY[table]))
                    if columns:
                        params = {"b_" + c: v for c, v in zip(_PRIMARY[table], key)}
                        params.update({"v_" + c: row[c] for c in columns})
                        updates.setdefault(columns, []).append(params)
            execute_many(self.conn, _STATEMENTS.delete[table], deletes)
            execute_many(self.conn, _STATEMENTS.insert[table], inserts)
            for columns, params in updates.items():
                execute_many(self.conn, _STATEMENTS.update(table, columns), params)
            for key, _changed in self._changed[table].items():
                if self._rows[table][key] is None:
                    self._stored[table].discard(key)
                else:
                    self._stored[table].add(key)
            self._changed[table] = {}
