"""The unit of work's reads (driver SQL, `driver_reads._Reader`) give what SQLAlchemy Core's
select gives for the same keys: the reference is `select(table).where(...)` on the same
connection. The rows are the awkward ones of the writes' test (JSON, bytes-like text, NULLs,
big integers, timestamps with microseconds); keys single and composite, some absent."""

from __future__ import annotations

import pytest
from sqlalchemy import Integer, and_, insert, or_, select

from eventing.store import database, driver_reads, row_tables
from eventing.store import tables as t
from eventing.store import unit_of_work as uow
from tests.eventing.sqlite_plans import plan_of
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
    columns = [table.c[name] for name in row_tables._PRIMARY[table.name]]
    match = or_(*(and_(*(c == v for c, v in zip(columns, key))) for key in keys))
    return {
        row_tables.key_of(table.name, dict(row._mapping)): dict(row._mapping)
        for row in conn.execute(select(table).where(match))
    }


@pytest.mark.parametrize(
    "table, keys",
    [
        (t.futures, [(f"read-{i}",) for i in range(len(AWKWARD))] + [("read-absent",)]),
        (
            t.submissions,
            [(row["tenant"], row["dedup_key"]) for row in submission_rows()[::3]]
            + [("alice", "absent"), ("carol", "seq::0")],
        ),
    ],
    ids=["single-key", "composite-key"],
)
def test_driver_reads_give_what_core_gives(engine, table, keys):
    with engine.connect() as conn:
        want = core(conn, table, keys)
        got = {
            row_tables.key_of(table.name, row): row
            for row in driver_reads._reader(conn.dialect, table.name).by_keys(conn, keys)
        }
        assert len(want) == len(keys) - (1 if table is t.futures else 2)  # the absent keys are absent
        assert got == want
        assert {type(v) for row in got.values() for v in row.values()} == {
            type(v) for row in want.values() for v in row.values()
        }
        # Through the unit of work, as the fold asks: every key known, present or absent.
        rows = uow.Rows(conn)
        rows.prefetch(table.name, keys)
        for key in keys:
            expected = want.get(key)
            if expected is not None:
                expected = {k: uow.utc(v) if k in row_tables._DATETIMES[table.name] else v for k, v in expected.items()}
            assert rows.get(table.name, *key) == expected


def test_a_read_sees_its_transactions_own_writes(engine):
    """The driver's cursor is the transaction's: a row inserted earlier in it is read back."""
    row = future_rows("own-")[2]
    with engine.begin() as conn:
        conn.execute(insert(t.futures), row)
        (got,) = driver_reads._reader(conn.dialect, "futures").by_keys(conn, [("own-2",)])
        assert got["result"] == row["result"] and got["tokens"] == row["tokens"]
        conn.rollback()
    with engine.connect() as conn:
        assert driver_reads._reader(conn.dialect, "futures").by_keys(conn, [("own-2",)]) == []


def test_a_runs_latest_step_reads_as_cores_greatest(engine):
    """`Rows.latest` over several runs at once (one UNION ALL in driver SQL) gives each run's
    row with the greatest step, as Core's own ORDER BY ... LIMIT 1 per run does; a run
    without steps has none."""
    when = future_rows("")[0]["created_at"]
    steps = [dict(model_id=f"m{m}", step=s, tenant="alice", tokens=s * 10, forward_backward=s % 4, loss=s * 0.5, metrics={"s": s}, first_request_at=when)
             for m in range(3) for s in (3, 11, 7)[: m + 1]]  # fmt: skip
    with engine.begin() as conn:
        conn.execute(insert(t.run_steps), steps)
    runs = ["m0", "m1", "m2", "m-none"]
    with engine.connect() as conn:
        rows = uow.Rows(conn)
        rows.prefetch_latest("run_steps", "step", "model_id", runs)
        for run in runs:
            want = conn.execute(
                select(t.run_steps).where(t.run_steps.c.model_id == run).order_by(t.run_steps.c.step.desc()).limit(1)
            ).first()
            got = rows.latest("run_steps", "step", "model_id", run)
            if want is None:
                assert got is None
            else:
                assert got == {
                    k: uow.utc(v) if k in row_tables._DATETIMES["run_steps"] else v for k, v in want._mapping.items()
                }
        assert [rows.latest("run_steps", "step", "model_id", run)["step"] for run in runs[:3]] == [3, 11, 11]


def test_a_projection_lookup_is_cores_row_for_its_tenant_and_nothing_for_another(engine):
    """`Projections`' lookups by id (every request's run, session or future) read in driver
    SQL: the row's columns as attributes, equal to Core's select; scoped to the owner."""
    from eventing.store.queries import Projections

    projections = Projections(engine)
    with engine.connect() as conn:
        want = conn.execute(select(t.futures).where(t.futures.c.request_id == "read-3")).first()
    got = projections.future("alice", "read-3")
    assert {name: getattr(got, name) for name in want._mapping} == dict(want._mapping) == dict(got._mapping)
    assert projections.future("bob", "read-3") is None  # another tenant's future is not found
    assert projections.future("alice", "read-absent") is None
    with pytest.raises(AttributeError):
        got.no_such_column


def test_a_lookups_values_are_processed_only_when_asked_for(engine, monkeypatch):
    """`LazyRow`: a column's result processor runs on its first read and never again, and
    never for a column not read (a run's lookup need not decode its JSON)."""
    from eventing.store.queries import Projections

    calls: list[str] = []
    reader = driver_reads._reader(engine.dialect, "futures")
    with engine.connect() as conn:
        reader.by_keys(conn, [("read-1",)])  # the processors are known from a first read
    monkeypatch.setattr(
        reader,
        "by_name",
        {name: (lambda v, n=name: calls.append(n) or v) for name in reader.by_name}
        | {"tokens": lambda v: calls.append("tokens") or v},
    )
    row = Projections(engine).future("alice", "read-1")
    assert "result" not in calls
    assert row.tokens == row.tokens == future_rows("")[1]["tokens"]
    assert calls.count("tokens") == 1


def test_a_fresh_rows_latest_is_the_greatest_of_what_it_holds_asked_in_any_order():
    """A rebuild's Rows (fresh: it holds every row there is) indexes a group's latest rows in
    one pass the first time any group is asked for, then keeps every group's answer as rows
    come, groups never asked for among them. The reference is the greatest step of each
    model among the rows inserted."""
    rows = uow.Rows(None, fresh=True)
    inserted: dict[str, int] = {}

    def step(model: str, number: int) -> None:
        rows.insert("run_steps", model_id=model, step=number, tenant="alice", tokens=0, forward_backward=0)
        inserted[model] = max(inserted.get(model, 0), number)

    def latest(model: str):
        row = rows.latest("run_steps", "step", "model_id", model)
        return row["step"] if row is not None else None

    step("a", 1), step("a", 2), step("b", 1)
    assert latest("a") == 2  # the first question: indexed here
    assert latest("c") is None
    step("d", 1), step("d", 3), step("d", 2)  # a group nobody asked for yet
    step("a", 3), step("c", 1)
    for model in ("a", "b", "c", "d"):
        assert latest(model) == inserted[model]


COMPOSITE = [name for name in t.metadata.tables if len(row_tables._PRIMARY.get(name, ())) > 1]


@pytest.mark.parametrize("count", [1, 8, 500])
@pytest.mark.parametrize("table", COMPOSITE)
def test_sqlite_reads_a_composite_key_by_its_whole_primary_key(tmp_path, table, count):
    """SQLite's plan for a read by composite keys searches the primary key with every one of
    its columns, once per key, and never scans the table: its row-value forms did (a scan
    for `IN (VALUES ...)`, the first column only for `IN (SELECT ...)`), so every batch's
    submissions lookup grew with the table (driver_reads._Reader)."""
    engine = database.make_engine(f"sqlite:///{tmp_path / 'plan.db'}")
    database.upgrade(engine)
    columns = row_tables._PRIMARY[table]
    keys = [
        tuple(i if isinstance(t.metadata.tables[table].c[c].type, Integer) else f"k{i}" for c in columns)
        for i in range(count)
    ]
    with engine.connect() as conn:
        sql, params = driver_reads._reader(conn.dialect, table).query(keys)
        plan = plan_of(conn, sql, params)
    engine.dispose()
    touching = [step for step in plan if f" {table} " in f" {step} "]
    whole_key = f"({' AND '.join(f'{c}=?' for c in columns)})"
    assert touching and all(
        step.startswith(f"SEARCH {table} USING") and step.endswith(whole_key) for step in touching
    ), plan
    assert len(touching) == count


def test_a_runs_steps_read_by_composite_key_as_core_reads_them(engine):
    """The integer half of a composite key (run_steps' step) matches as Core's select does."""
    when = future_rows("")[0]["created_at"]
    steps = [
        dict(model_id=f"m{m}", step=s, tenant="alice", tokens=s, forward_backward=1, first_request_at=when)
        for m in range(2)
        for s in range(5)
    ]
    with engine.begin() as conn:
        conn.execute(insert(t.run_steps), steps)
    keys = [("m0", 0), ("m0", 4), ("m1", 2), ("m1", 9), ("m9", 0)]
    with engine.connect() as conn:
        want = core(conn, t.run_steps, keys)
        got = {
            row_tables.key_of("run_steps", row): row
            for row in driver_reads._reader(conn.dialect, "run_steps").by_keys(conn, keys)
        }
    assert sorted(want) == [("m0", 0), ("m0", 4), ("m1", 2)]
    assert got == want
