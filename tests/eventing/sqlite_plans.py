"""SQLite's query plans, for tests that a read searches an index instead of scanning a table
that grows with every request (a scan is fast on a test's few rows and slow on a store's
millions, so only the plan shows it)."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from sqlalchemy import event


def plan_of(conn, sql: str, params=()) -> list[str]:
    """The detail column of `EXPLAIN QUERY PLAN sql` on a SQLAlchemy connection."""
    return [
        row[3]
        for row in conn.exec_driver_sql(
            f"EXPLAIN QUERY PLAN {sql}", tuple(params) if isinstance(params, list) else params
        )
    ]


def scanned(conn, table: str, seen: list[tuple[str, object]]) -> list[tuple[str, list[str]]]:
    """The statements of `seen` ((sql, params), SELECTs) whose plan scans `table` whole."""
    found = []
    for sql, params in seen:
        if not sql.lstrip().upper().startswith("SELECT"):
            continue
        plan = plan_of(conn, sql, params)
        if any(step == f"SCAN {table}" or step.startswith(f"SCAN {table} ") for step in plan):
            found.append((sql, plan))
    return found


class Tracer:
    """Every statement SQLite runs for `engine`'s connections made from now on, with its
    values in place (sqlite3's trace callback: the unit of work's point reads go to the
    driver's cursor past SQLAlchemy's events). Make it before the engine's first connection."""

    def __init__(self, engine) -> None:
        self._seen: Optional[list[str]] = None
        event.listen(
            engine, "connect", lambda dbapi_connection, _record: dbapi_connection.set_trace_callback(self._trace)
        )

    def _trace(self, sql: str) -> None:
        if self._seen is not None:
            self._seen.append(sql)

    @contextlib.contextmanager
    def statements(self) -> Iterator[list[tuple[str, object]]]:
        """(sql, ()) of every statement run inside the block."""
        self._seen = []
        found: list[tuple[str, object]] = []
        try:
            yield found
        finally:
            found += [(sql, ()) for sql in self._seen]
            self._seen = None
