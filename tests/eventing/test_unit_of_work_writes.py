"""The unit of work's batched writes store exactly what one INSERT per row stores.

On PostgreSQL a batch of inserts goes as one COPY (`driver_writes._RowsInsert`), on SQLite as
one executemany; the reference is the same rows written one statement each (SQLAlchemy's
own `conn.execute(insert(table), row)`), read back from another part of the same table.
The values are the awkward ones for COPY's text format: tabs, newlines, backslashes, quotes,
NUL bytes and non-ASCII text, JSON nulls and nested JSON, SQL NULLs, big integers, booleans
and timestamps with microseconds.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError

from eventing.store import database, driver_writes
from eventing.store import tables as t
from eventing.store import unit_of_work as uow

AWKWARD = ["plain", "tab\there", "line\nbreak\r\n", "back\\slash \\N \\.", "quote ' and \"", "ünïcødé ✓ 日本", ""]
WHEN = datetime(2026, 12, 3, 7, 30, 15, 123456, tzinfo=timezone.utc)


def future_rows(prefix: str) -> list[dict]:
    rows = []
    for i, text in enumerate(AWKWARD):
        rows.append(
            dict(
                request_id=f"{prefix}{i}", tenant="alice", kind="optim_step", session_id=None if i % 2 else f"s{i}",
                model_id=text or None, state="completed" if i % 3 else "pending",
                result=None if i == 0 else {"metrics": {"loss:sum": 1.5 + i, "note": text}, "list": [1, None, True, text], "empty": {}},
                error=text if i % 2 else None, category=None, created_at=WHEN + timedelta(seconds=i),
                completed_at=None if i % 3 == 0 else WHEN + timedelta(minutes=i), tokens=(1 << 40) + i if i % 2 else None,
                prefill_tokens=i if i % 2 else None, sampled_tokens=None if i % 2 else (1 << 33) + i,
            )
        )  # fmt: skip
    return rows


def event_rows(prefix: str) -> list[dict]:
    rows = []
    for i, text in enumerate(AWKWARD):
        rows.append(
            dict(
                id=f"{prefix}{i}", type="ai.openrl.training.optim_step.completed.v1", source="/t", tenant="alice",
                key=text or None, subject=None, time=WHEN + timedelta(microseconds=i),
                data=None if i == 0 else bytes(range(256)) + text.encode() + b"\x00\\\t\n",
                claim_sha256=None, claim_size=None if i % 2 else (1 << 50) + i,
                dedup_key=f"seq:{text}:{i}" if i % 2 else None, dedup_sha256="ab" * 32 if i % 2 else None,
                dedup_rejected=bool(i % 3) if i % 2 else None, lease_id=(1 << 62) + i if i % 2 else None,
                fenced=True if i == 3 else None,
            )
        )  # fmt: skip
    return rows


def stored(engine, table, column: str, prefix: str) -> dict:
    with engine.connect() as conn:
        found = conn.execute(select(table).where(table.c[column].like(prefix + "%"))).mappings().all()
    rows = {}
    for row in found:
        row = {k: uow.utc(v) if isinstance(v, datetime) else v for k, v in row.items() if k != "position"}
        rows[row.pop(column)[len(prefix) :]] = row
    return rows


@pytest.fixture
def engine(store_url):
    engine = database.make_engine(store_url)
    database.upgrade(engine)
    yield engine
    engine.dispose()


@pytest.mark.parametrize(
    "table, column, make",
    [(t.futures, "request_id", future_rows), (t.events, "id", event_rows)],
    ids=["futures", "events"],
)
def test_a_batch_stores_what_one_insert_per_row_stores(engine, table, column, make):
    batch, reference = make("batch-"), make("alone-")
    with engine.begin() as conn:
        driver_writes.execute_many(conn, insert(table), batch)
        for row in reference:
            conn.execute(insert(table), row)
    by_batch, alone = stored(engine, table, column, "batch-"), stored(engine, table, column, "alone-")
    assert len(by_batch) == len(AWKWARD)
    assert by_batch == alone
    # And both are the values written (JSON and bytes round-trip, datetimes keep microseconds).
    for i, row in enumerate(make("")):
        expected = {k: v for k, v in row.items() if k != column}
        assert by_batch[str(i)] == expected
    compiled = [
        c for (statement_id, dialect, _keys), c in driver_writes._COMPILED.items() if dialect == engine.dialect.name
    ]
    if engine.dialect.name == "postgresql":  # the batch really went as a COPY, not a fallback
        assert any(
            c.rows_insert is not None and c.rows_insert.copy_sql.startswith(f"COPY {table.name} (") for c in compiled
        )


def test_a_batch_with_a_row_already_stored_raises_integrity_error_and_stores_nothing(engine):
    rows = future_rows("dup-")
    with engine.begin() as conn:
        conn.execute(insert(t.futures), rows[3])
    with pytest.raises(IntegrityError):
        with engine.begin() as conn:
            driver_writes.execute_many(conn, insert(t.futures), rows)
    assert list(stored(engine, t.futures, "request_id", "dup-")) == ["3"]
    # The connection went back to the pool usable: the next batch goes through.
    with engine.begin() as conn:
        driver_writes.execute_many(conn, insert(t.futures), rows[:3] + rows[4:])
    assert sorted(stored(engine, t.futures, "request_id", "dup-")) == [str(i) for i in range(len(AWKWARD))]


def test_one_row_already_stored_raises_integrity_error_as_sqlalchemys(engine):
    """A single row goes to the driver without SQLAlchemy (`driver_writes.driver_execute`,
    not a COPY on PostgreSQL): its unique violation still comes out as SQLAlchemy's
    IntegrityError, and the connection serves the next transaction."""
    rows = future_rows("one-")
    with engine.begin() as conn:
        driver_writes.execute_many(conn, insert(t.futures), rows[:1])
    with pytest.raises(IntegrityError, match="one-0|UNIQUE|unique|duplicate"):
        with engine.begin() as conn:
            driver_writes.execute_many(conn, insert(t.futures), rows[:1])
    with engine.begin() as conn:
        driver_writes.execute_many(conn, insert(t.futures), rows[1:2])
    assert sorted(stored(engine, t.futures, "request_id", "one-")) == ["0", "1"]
