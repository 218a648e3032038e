"""The projection tables as the unit of work sees them: their columns, primary keys and
datetime columns, a row's key, and the statements built once per table.

A row is a dict of every column of its table (`Row`); its key is the tuple of its primary
key's values in the table's key order (`Key`, `key_of`), for one-column keys too. The write
statements (`_STATEMENTS`) and the per-group top-row reads (`_top_rows`) are built once with
bind parameters, because building one per call cost more than running it. Nothing here
touches a connection.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

from sqlalchemy import DateTime, bindparam, delete, insert, select, union_all, update

from eventing.store import tables as t

Row = dict[str, Any]
Key = tuple

TABLES = {
    table.name: table
    for table in (
        t.sessions,
        t.training_runs,
        t.run_steps,
        t.checkpoints,
        t.removed_checkpoints,
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


def primary_key(table: str) -> list[str]:
    return list(_PRIMARY[table])


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
