"""PostgreSQL's round trips on the store's hot paths (eventing/store/pg_round_trips.py), on
the local server: reads outside a transaction, small write transactions pipelined with their
commit (errors still surfacing as SQLAlchemy's, nothing half-stored), and a ping only for a
connection that sat idle, which still replaces one the server dropped."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError, IntegrityError

from eventing.store import pg_round_trips
from eventing.store import tables as t
from eventing.store.database import make_engine, upgrade
from eventing.store.driver_writes import driver_execute, execute_many
from eventing.store.event_store import EventStore
from eventing.store.kept import kept
from tests.conftest import PG_ADMIN

pytestmark = pytest.mark.postgres


@pytest.fixture
def engine(pg_url):
    engine = make_engine(pg_url)
    upgrade(engine)
    yield engine
    engine.dispose()


class _RoundTrips:
    """libpq's protocol trace of `conn`: each turn from the client's messages to the server's
    is one round trip (the client sent, then waited for an answer)."""

    def __init__(self, conn, path) -> None:
        raw = conn.driver_connection if hasattr(conn, "driver_connection") else conn.connection.driver_connection
        self.pgconn = raw.pgconn
        self.file = open(path, "w")
        self.path = path
        self.pgconn.trace(self.file.fileno())

    def stop(self) -> int:
        self.pgconn.untrace()
        self.file.close()
        turns, last = 0, None
        for line in open(self.path):
            side = line.split("\t")[1] if line.count("\t") > 1 else None
            if side == "B" and last == "F":
                turns += 1
            last = side or last
        return turns


def _session_rows(n: int, start: int = 0) -> list[dict]:
    now = datetime.now(timezone.utc)
    return [
        dict(session_id=f"s{i}", tenant="t", tags=[], user_metadata={}, created_at=now) for i in range(start, start + n)
    ]


def test_a_read_opens_no_transaction(engine):
    with pg_round_trips.read_connection(engine) as conn:
        assert conn.exec_driver_sql("SELECT 1").scalar() == 1
        # Outside a transaction: nothing to roll back, no snapshot kept, no BEGIN sent.
        assert conn.connection.driver_connection.info.transaction_status.name == "IDLE"
    with engine.connect() as conn:  # the pooled connection is back to transactions for others
        conn.exec_driver_sql("SELECT 1")
        assert conn.connection.driver_connection.info.transaction_status.name == "INTRANS"


def test_a_pipelined_transaction_commits_its_writes_in_fewer_round_trips(engine, tmp_path):
    with engine.connect() as conn:
        trips = _RoundTrips(conn, tmp_path / "plain.trace")
        with conn.begin():
            for row in _session_rows(5):
                execute_many(conn, t.sessions.insert(), [row])
        plain = trips.stop()
    with pg_round_trips.pipelined(engine) as conn:
        trips = _RoundTrips(conn, tmp_path / "pipelined.trace")
        assert pg_round_trips.in_pipeline(conn)
        for row in _session_rows(5, start=10):
            execute_many(conn, t.sessions.insert(), [row])
    pipelined = trips.stop()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM sessions")).scalar() == 10
    # Unpipelined: BEGIN, each of the five writes and COMMIT wait for the server. Pipelined:
    # BEGIN, the writes and COMMIT go together, with the pipeline's closing sync.
    assert plain == 7
    assert pipelined == 1


def test_a_failed_write_in_the_pipeline_raises_integrity_error_and_stores_nothing(engine):
    with engine.begin() as conn:
        execute_many(conn, t.sessions.insert(), _session_rows(1))
    with pytest.raises(IntegrityError, match="duplicate|unique"):
        with pg_round_trips.pipelined(engine) as conn:
            execute_many(conn, t.sessions.insert(), _session_rows(3, start=5))  # several rows: not COPY here
            execute_many(conn, t.sessions.insert(), _session_rows(1))  # s0 again
    with engine.connect() as conn:
        assert conn.execute(text("SELECT session_id FROM sessions ORDER BY 1")).scalars().all() == ["s0"]
    # The pool's connection serves the next transaction.
    with pg_round_trips.pipelined(engine) as conn:
        execute_many(conn, t.sessions.insert(), _session_rows(1, start=9))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM sessions")).scalar() == 2


def test_a_large_batch_goes_by_copy_outside_the_pipeline(engine):
    rows = pg_round_trips.PIPELINE_MOST_ROWS + 1
    keep = kept(engine)
    with keep.begin(rows=rows) as conn:
        assert not pg_round_trips.in_pipeline(conn)
        execute_many(conn, t.sessions.insert(), _session_rows(rows))
    with keep.begin(rows=3) as conn:
        assert pg_round_trips.in_pipeline(conn)
        driver_execute(conn, "DELETE FROM sessions WHERE session_id = %s", [("s0",)])
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM sessions")).scalar() == rows - 1


def test_a_store_batch_broken_by_a_twin_row_falls_back_one_by_one(engine, tmp_path, monkeypatch):
    """A concurrent writer's twin row is only found by the database: in the pipeline its
    unique violation surfaces at the commit, and the batch is appended item by item."""
    from eventing.blobs import BlobStore
    from eventing.codec import Codec
    from eventing.store import event_store
    from openrl_core.events import new_event
    from openrl_core.events import sessions as se

    store = EventStore(engine, Codec(BlobStore(tmp_path / "blobs")))
    first = new_event(se.SESSION_CREATED, se.SessionCreated(session_id="s1"), tenant="t", source="/test")
    assert store.append(first).stored
    second = new_event(se.SESSION_CREATED, se.SessionCreated(session_id="s2"), tenant="t", source="/test")
    real = event_store._known_ids_queries
    monkeypatch.setattr(event_store, "_known_ids_queries", lambda dialect, ids: [])  # as if the twin came in meanwhile
    with pytest.raises(IntegrityError):
        with engine.connect() as conn, conn.begin():
            store._fold_batch(conn, [(first, None, None)], raise_conflicts=False)
    # Through the pipelined path, the fallback answers each item on its own.
    calls = []
    monkeypatch.setattr(
        event_store,
        "_known_ids_queries",
        lambda dialect, ids: calls.append(ids) or ([] if len(calls) == 1 else real(dialect, ids)),
    )
    outcomes = store.append_many([(first, None, None), (second, None, None)])
    assert [o.stored for o in outcomes] == [False, True]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM events")).scalar() == 2


def test_an_idle_connection_is_pinged_and_a_dropped_one_replaced(pg_url):
    engine = create_engine(pg_url.replace("postgresql://", "postgresql+psycopg://"), pool_size=1, max_overflow=0)
    pg_round_trips.install(engine, idle_seconds=0.2)
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        with admin.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        time.sleep(0.3)  # idle past the threshold: the checkout pings, finds it gone, replaces it
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT pg_backend_pid()").scalar() != pid
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        with admin.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        time.sleep(0.05)
        # In steady use (not idle): no ping, so the dropped connection fails its statement,
        # flagged as a disconnect (the gateway answers 503), and the next checkout is fresh.
        with pytest.raises(DBAPIError) as failed:
            with engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
        assert failed.value.connection_invalidated
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT pg_backend_pid()").scalar() != pid
    finally:
        admin.dispose()
        engine.dispose()


def test_a_read_sqlalchemy_runs_inside_the_pipeline_sees_its_rows(engine):
    """`Rows.select` (a run's open futures when it is cancelled) goes through SQLAlchemy,
    which looks at the cursor at once: the pipeline is synced for it, so it reads the rows
    written earlier in the same transaction too."""
    from eventing.store.unit_of_work import Rows

    with engine.begin() as conn:
        execute_many(conn, t.sessions.insert(), _session_rows(2))
    with pg_round_trips.pipelined(engine) as conn:
        execute_many(conn, t.sessions.insert(), _session_rows(1, start=2))
        rows = Rows(conn)
        found = sorted(row["session_id"] for row in rows.select("sessions", tenant="t"))
    assert found == ["s0", "s1", "s2"]


def test_a_dropped_connection_under_a_driver_read_is_a_flagged_error_and_the_pool_starts_afresh(pg_url):
    """The store's hot reads go to the driver past SQLAlchemy: a connection the server
    dropped (no ping: it was in use a moment ago) still fails as SQLAlchemy would fail it,
    flagged as invalidated (the gateway's 503), and every other connection of the pool made
    before it is replaced too."""
    from eventing.store.queries import Projections

    engine = make_engine(pg_url)
    upgrade(engine)
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    reads = Projections(engine)
    try:
        with engine.connect() as a, engine.connect() as b:  # two pooled connections, both used now
            pids = {c.exec_driver_sql("SELECT pg_backend_pid()").scalar() for c in (a, b)}
        with admin.connect() as conn:
            for pid in pids:
                conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        time.sleep(0.05)
        with pytest.raises(DBAPIError) as failed:
            reads.run("t", "no-such-model")
        assert failed.value.connection_invalidated and type(failed.value).__name__ == "OperationalError"
        assert reads.run("t", "no-such-model") is None  # the other dropped one was replaced, not used
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT pg_backend_pid()").scalar() not in pids
    finally:
        admin.dispose()
        engine.dispose()


def test_a_batch_of_training_requests_costs_the_store_two_round_trips(engine, tmp_path):
    """The group-commit writer's transaction for a batch of `optim_step` submissions: which
    events are known, the submissions, the futures, the runs all go in one round trip (with
    BEGIN), then the writes go with COMMIT. Main before these changes made about twelve: a ping,
    BEGIN, four reads, five writes, COMMIT."""
    from sqlalchemy import event as sa_event

    from eventing.blobs import BlobStore
    from eventing.codec import Codec
    from eventing.store.event_store import Dedup
    from openrl_core.events import new_event
    from openrl_core.events import sessions as se
    from openrl_core.events import training as te
    from openrl_core.params import AdamParams, LoraConfig

    store = EventStore(engine, Codec(BlobStore(tmp_path / "blobs")))
    store.append(new_event(se.SESSION_CREATED, se.SessionCreated(session_id="s1"), tenant="t", source="/test"))
    for n in range(4):
        created = te.CreateModelRequested(
            request_id=f"req-create-{n}", session_id="s1", model_id=f"m{n}", model_seq_id=n,
            base_model="openrl/tiny-qwen3", lora_config=LoraConfig(rank=4),
        )  # fmt: skip
        store.append(new_event(te.CREATE_MODEL["requested"], created, tenant="t", source="/test", key=f"m{n}"))
    steps = [
        (new_event(te.OPTIM_STEP["requested"], te.OptimStepRequested(request_id=f"req-step-{n}", model_id=f"m{n}", seq_id=1, adam_params=AdamParams()),
                   tenant="t", source="/test", key=f"m{n}"), "t.training", Dedup.of(f"seq:m{n}:1", b"body"))
        for n in range(4)
    ]  # fmt: skip
    traces = []

    def trace(_dbapi_connection, _record, proxy) -> None:
        traces.append(_RoundTrips(proxy, tmp_path / f"{len(traces)}.trace"))

    sa_event.listen(engine, "checkout", trace)
    try:
        outcomes = store.append_many(steps)
    finally:
        sa_event.remove(engine, "checkout", trace)
    assert [o.stored for o in outcomes] == [True] * 4
    assert sum(t.stop() for t in traces) == 2
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM futures WHERE request_id LIKE 'req-step-%'")).scalar() == 4
        assert conn.execute(text("SELECT count(*) FROM outbox")).scalar() == 4
    # The next batch's transaction also deletes the published batch's outbox rows (the
    # appender's deferred clean-up): still two round trips, no transaction of their own.
    published = [event.id for event, _topic, _dedup in steps]
    more = [
        (new_event(te.OPTIM_STEP["requested"], te.OptimStepRequested(request_id=f"req-step2-{n}", model_id=f"m{n}", seq_id=2, adam_params=AdamParams()),
                   tenant="t", source="/test", key=f"m{n}"), "t.training", Dedup.of(f"seq:m{n}:2", b"body"))
        for n in range(4)
    ]  # fmt: skip
    traces.clear()
    sa_event.listen(engine, "checkout", trace)
    try:
        outcomes = store.append_many(more, published=published)
    finally:
        sa_event.remove(engine, "checkout", trace)
    assert [o.stored for o in outcomes] == [True] * 4
    assert sum(t.stop() for t in traces) == 2
    with engine.connect() as conn:
        left = conn.execute(text("SELECT event_id FROM outbox")).scalars().all()
    assert sorted(left) == sorted(event.id for event, _topic, _dedup in more)
