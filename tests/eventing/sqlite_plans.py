"""SQLite's query plans, for tests that a read searches an index instead of scanning a table
that grows with every request (a scan is fast on a test's few rows and slow on a store's
millions, so only the plan shows it)."""

from __future__ import annotations

import contextlib
from typing import Iterator

from sqlalchemy import event


def plan_of(conn, sql: str, params=()) -> list[str]:
    """The detail column of `EXPLAIN QUERY PLAN sql` on a SQLAlchemy connection."""
    return [row[3] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}", tuple(params) if isinstance(params, list) else params)]


@contextlib.contextmanager
def statements(engine) -> Iterator[list[tuple[str, object]]]:
    """Every (sql, parameters) the engine's cursors execute inside the block."""
    seen: list[tuple[str, object]] = []

    def record(_conn, _cursor, sql, params, _context, _executemany):
        seen.append((sql, params))

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def scanned(conn, table: str, seen: list[tuple[str, object]]) -> list[tuple[str, list[str]]]:
    """The statements of `seen` (SELECTs) whose plan scans `table` whole."""
    found = []
    for sql, params in seen:
        if not sql.lstrip().upper().startswith("SELECT"):
            continue
        plan = plan_of(conn, sql, params)
        if any(step == f"SCAN {table}" or step.startswith(f"SCAN {table} ") for step in plan):
            found.append((sql, plan))
    return found
