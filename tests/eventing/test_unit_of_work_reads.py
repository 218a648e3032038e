"""The unit of work's reads (driver SQL, `unit_of_work._Reader`) give what SQLAlchemy Core's
select gives for the same keys: the reference is `select(table).where(...)` on the same
connection. The rows are the awkward ones of the writes' test (JSON, bytes-like text, NULLs,
big integers, timestamps with microseconds); keys single and composite, some absent."""

from __future__ import annotations

import pytest
from sqlalchemy import and_, insert, or_, select

from eventing.store import database
from eventing.store import tables as t
from eventing.store import unit_of_work as uow
from tests.eventing.test_unit_of_work_writes import AWKWARD, future_rows


def submission_rows() -> list[dict]:
    return [
        dict(tenant=tenant, dedup_key=f"seq:{text}:{i}", request_id=None if i % 2 else f"r{i}", payload_sha256="ab" * 32, rejected=bool(i % 3))
        for i, text in enumerate(AWKWARD)
        for tenant in ("alice", "bob ✓")
    ]  # fmt: skip


@pytest.fixture
def engine(store_url):
    engine = database.make_engine(store_url)
    database.upgrade(engine)
    with engine.begin() as conn:
        conn.execute(insert(t.futures), future_rows("read-"))
        conn.execute(insert(t.submissions), submission_rows())
    yield engine
    engine.dispose()


def core(conn, table, keys) -> dict:
    columns = [table.c[name] for name in uow._PRIMARY[table.name]]
    match = or_(*(and_(*(c == v for c, v in zip(columns, key))) for key in keys))
    return {uow.key_of(table.name, dict(row._mapping)): dict(row._mapping) for row in conn.execute(select(table).where(match))}


@pytest.mark.parametrize(
    "table, keys",
    [
        (t.futures, [(f"read-{i}",) for i in range(len(AWKWARD))] + [("read-absent",)]),
        (t.submissions, [(row["tenant"], row["dedup_key"]) for row in submission_rows()[::3]] + [("alice", "absent"), ("carol", "seq::0")]),
    ],
    ids=["single-key", "composite-key"],
)
def test_driver_reads_give_what_core_gives(engine, table, keys):
    with engine.connect() as conn:
        want = core(conn, table, keys)
        got = {uow.key_of(table.name, row): row for row in uow._reader(conn.dialect, table.name).by_keys(conn, keys)}
        assert len(want) == len(keys) - (1 if table is t.futures else 2)  # the absent keys are absent
        assert got == want
        assert {type(v) for row in got.values() for v in row.values()} == {type(v) for row in want.values() for v in row.values()}
        # Through the unit of work, as the fold asks: every key known, present or absent.
        rows = uow.Rows(conn)
        rows.prefetch(table.name, keys)
        for key in keys:
            expected = want.get(key)
            if expected is not None:
                expected = {k: uow.utc(v) if k in uow._DATETIMES[table.name] else v for k, v in expected.items()}
            assert rows.get(table.name, *key) == expected


def test_a_read_sees_its_transactions_own_writes(engine):
    """The driver's cursor is the transaction's: a row inserted earlier in it is read back."""
    row = future_rows("own-")[2]
    with engine.begin() as conn:
        conn.execute(insert(t.futures), row)
        (got,) = uow._reader(conn.dialect, "futures").by_keys(conn, [("own-2",)])
        assert got["result"] == row["result"] and got["tokens"] == row["tokens"]
        conn.rollback()
    with engine.connect() as conn:
        assert uow._reader(conn.dialect, "futures").by_keys(conn, [("own-2",)]) == []
