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

The unit of work is four modules: this one (`Rows`), `row_tables` (the tables' columns,
keys and statements), `driver_reads` (reads by key in driver SQL) and `driver_writes`
(executemany, COPY, deferred writes).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Iterable, Optional, Sequence, Union, cast, overload

from sqlalchemy import select
from sqlalchemy.engine import Connection

from eventing.store.driver_reads import _driver_sql, _reader, driver_rows, driver_rows_many
from eventing.store.driver_writes import execute_many
from eventing.store.row_tables import (
    _COLUMN_SETS,
    _COLUMNS,
    _DATETIMES,
    _KEY_OF,
    _PRIMARY,
    _STATEMENTS,
    TABLES,
    Key,
    Row,
    _top_rows,
    key_of,
)


def _matches(row: Row, equal: dict) -> bool:
    return all(row[c] in v if isinstance(v, tuple) else row[c] == v for c, v in equal.items())


@overload
def utc(value: datetime) -> datetime: ...
@overload
def utc(value: None) -> None: ...
@overload
def utc(value: Optional[datetime]) -> Optional[datetime]: ...


def utc(value: Optional[datetime]) -> Optional[datetime]:
    """SQLite hands datetimes back naive; everything stored here is UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=timezone.utc)


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
        # Per row, the columns changed; the table's shared frozenset of every column for a row
        # inserted whole (`insert`).
        self._changed: dict[str, dict[Key, Union[set[str], frozenset[str]]]] = {name: {} for name in TABLES}
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

    def prefetch_many(self, wanted: list[tuple[str, Iterable[Key]]], also: Sequence[tuple[str, Any]] = ()) -> list:
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
                key=lambda key: cast(Row, self._rows[table][key])[column], default=None,
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
                if current is None or cast(Row, cache[current])[column] <= row[column]:  # a top is a known row
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
                if current is None or cast(Row, self._rows[table][current])[column] <= row[column]:
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
        every = not isinstance(changed, set)  # inserted whole (`_COLUMN_SETS`): every column is written already
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
