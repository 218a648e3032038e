"""A rebuild into an empty store keeps its rows in memory across batches and reads nothing
back; its tables are those of the live fold exactly, in small batches (a request and its
completion in different transactions), past its bound on rows kept, and with payloads
claim-checked into another blob store."""

from __future__ import annotations

import gc
import threading
import time

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy import event as sa_event
from sqlalchemy.pool import StaticPool

from eventing.blobs import BlobStore
from eventing.codec import Codec
from eventing.replay import diff, rebuild, rebuild_from_events
from eventing.store import database, driver_reads, tables
from eventing.store import unit_of_work as uow
from eventing.store.driver_writes import DeferredWrites
from eventing.store.event_store import Dedup, EventStore
from eventing.store.queries import Projections
from eventing.store.sqlite_writer import SqliteWriter
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.events.lifecycle import RequestCompleted
from openrl_core.params import AdamParams
from tests.conftest import scratch_pg_database
from tests.eventing.test_replay import fresh, history


def steps(store: EventStore, count: int) -> None:
    """Training steps of s1's run after `history`: forward_backward and optim_step, each
    requested and completed, so the per-step projection reads the run's latest step."""
    model = "s1:train:0"
    for step in range(count):
        seq = 10 + 2 * step
        for verb, payload, result in (
            (te.FORWARD_BACKWARD, te.ForwardBackwardRequested(request_id=f"f{step}", model_id=model, seq_id=seq, loss_fn="cross_entropy", data=[]),
             {"loss_fn_outputs": [], "metrics": {"loss:sum": 1.5 + step}}),
            (te.OPTIM_STEP, te.OptimStepRequested(request_id=f"g{step}", model_id=model, seq_id=seq + 1, adam_params=AdamParams()),
             {"metrics": {"optim/grad_norm": 0.5}}),
        ):  # fmt: skip
            dedup = Dedup.of(f"seq:{model}:{payload.seq_id}", payload.model_dump_json().encode())
            store.append(new_event(verb["requested"], payload, tenant="alice", source="/t", key=model), dedup=dedup)
            done = RequestCompleted(request_id=payload.request_id, result=result, details={"tokens": 8})
            store.append(new_event(verb["completed"], done, tenant="alice", source="/t", key=model))


def selects(engine, monkeypatch) -> list[str]:
    """The SELECTs run on `engine`: through SQLAlchemy, and the unit of work's and the event
    store's reads in driver SQL (`driver_reads.driver_rows`, and `driver_rows_many`, which
    sends a pipelined transaction's reads together), which SQLAlchemy's events do not see."""
    seen: list[str] = []

    @sa_event.listens_for(engine, "before_cursor_execute")
    def count(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append(statement)

    def driver_rows(conn, sql, params, _read=driver_reads.driver_rows):
        if conn.engine is engine:
            seen.append(sql)
        return _read(conn, sql, params)

    def driver_rows_many(conn, queries, _read=driver_reads.driver_rows_many):
        if driver_reads.sent_together(conn, queries) and conn.engine is engine:
            seen.extend(sql for sql, _params in queries)  # otherwise each goes through driver_rows
        return _read(conn, queries)

    # The unit of work calls both by the names it imported; `driver_rows_many` calls
    # `driver_rows` in its own module when it sends the reads one by one.
    for module in (uow, driver_reads):
        monkeypatch.setattr(module, "driver_rows", driver_rows)
    monkeypatch.setattr(uow, "driver_rows_many", driver_rows_many)
    return seen


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def target_url(request, tmp_path):
    """Where a rebuild writes (a database of its own): on PostgreSQL its batches' writes
    run behind the next fold."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'rebuilt.db'}"
        return
    with scratch_pg_database() as url:
        yield url


@pytest.fixture
def live(store_url, tmp_path):
    live_store, projections = fresh(tmp_path, "live.db", store_url)
    history(live_store)
    steps(live_store, 4)
    return live_store, projections


def test_a_rebuild_into_an_empty_store_reads_nothing_back_and_matches(live, tmp_path, target_url, monkeypatch):
    live_store, projections = live
    target, rebuilt = fresh(tmp_path, "rebuilt.db", target_url)
    seen = selects(target.engine, monkeypatch)
    count, _ = rebuild(live_store, target, batch=3)
    assert count == 30
    assert len(seen) == 1 and "count" in seen[0].lower()  # whether the target was empty, and nothing after
    assert diff(projections, rebuilt) == []
    assert sorted(row["step"] for row in rebuilt.table_rows("run_steps")) == [1, 2, 3, 4]
    assert gc.get_freeze_count() == 0  # what the batches froze is the collector's again
    assert gc.isenabled()  # and the collector, off during the batches, is on again


def test_the_rows_kept_are_bounded_and_the_rest_reads_as_the_live_path(live, tmp_path, target_url, monkeypatch):
    live_store, projections = live
    target, rebuilt = fresh(tmp_path, "rebuilt.db", target_url)
    seen = selects(target.engine, monkeypatch)
    rebuilder = target.rebuilder()
    rebuilder.keep = 5
    chunk = [(event, dedup) for _, event, dedup in live_store.read_with_dedup(0, 100)]
    assert rebuilder.fresh
    for start in range(0, len(chunk), 3):
        rebuilder.append(chunk[start : start + 3])
    rebuilder.close()
    assert not rebuilder.fresh
    assert len(seen) > 1  # past the bound, batches read what they need (no diff has run yet)
    assert diff(projections, rebuilt) == []


def test_into_a_store_that_holds_events_every_batch_reads_as_the_live_path(live, tmp_path, target_url):
    live_store, projections = live
    events = [(event, dedup) for _, event, dedup in live_store.read_with_dedup(0, 100)]
    target, rebuilt = fresh(tmp_path, "backup.db", target_url)
    target.append_batch(events[:7])  # a backup taken after the first 7 events
    assert not target.rebuilder().fresh
    assert rebuild_from_events(events, target, batch=4)[0] == len(events) - 7
    assert diff(projections, rebuilt) == []


def test_inline_payloads_are_copied_as_stored_and_claim_checked_ones_go_to_the_targets_blobs(tmp_path):
    engine = database.make_engine(f"sqlite:///{tmp_path / 'live.db'}")
    database.upgrade(engine)
    live_store = EventStore(engine, Codec(BlobStore(tmp_path / "live-blobs"), inline_limit=150))
    history(live_store)
    steps(live_store, 2)
    target_engine = database.make_engine(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    database.upgrade(target_engine)
    target = EventStore(target_engine, Codec(BlobStore(tmp_path / "rebuilt-blobs"), inline_limit=150))
    rebuild(live_store, target, batch=4)
    assert diff(Projections(engine), Projections(target_engine)) == []

    def stored(e):
        with e.connect() as conn:
            return {row.id: row for row in conn.execute(select(tables.events))}

    source, copied = stored(engine), stored(target_engine)
    claimed = [i for i, row in source.items() if row.claim_sha256]
    assert claimed and len(claimed) < len(source)  # both kinds are in the history
    for event_id, row in source.items():
        assert copied[event_id].data == row.data and copied[event_id].claim_sha256 == row.claim_sha256
    # The claim-checked payloads decode from the target's own blob store.
    assert [e.data for _, e in target.read(0, 100)] == [e.data for _, e in live_store.read(0, 100)]


def test_the_collector_is_off_only_during_a_rebuild_and_left_off_if_it_was(live, tmp_path):
    live_store, _projections = live
    seen: list[bool] = []
    target, _rebuilt = fresh(tmp_path, "rebuilt.db")
    real = target._fold_batch

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    target._fold_batch = spy
    rebuild(live_store, target, batch=5)
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()  # a caller that runs without the collector keeps running without it
    try:
        other, _ = fresh(tmp_path, "other.db")
        rebuild(live_store, other, batch=5)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_row_another_writer_stored_first_sends_the_batch_down_the_live_path(live, tmp_path, target_url):
    """Another writer stores one of a later batch's events while the rebuild runs: that
    batch's transaction fails (on PostgreSQL only once its writes run behind the next fold)
    and it is appended again on the live path, which finds the event stored; the count of
    new events leaves it out and the projections still match."""
    live_store, projections = live
    events = [(event, dedup) for _, event, dedup in live_store.read_with_dedup(0, 100)]
    target, rebuilt = fresh(tmp_path, "rebuilt.db", target_url)
    other = EventStore(target.engine, target.codec)
    real_fold, real_batch, folds, live_batches = target._fold_batch, target.append_batch, [], []

    def fold(*args, **kwargs):
        folds.append(1)
        if len(folds) == 2:  # the second batch: the other writer gets its first event in first,
            committed(target.engine, events[3][0].id)  # once the first batch is in (it may be in flight)
            event, dedup = events[4]
            assert other.append(event, dedup=dedup).stored
        return real_fold(*args, **kwargs)

    def append_batch(batch):
        live_batches.append([event.id for event, _dedup in batch])
        return real_batch(batch)

    target._fold_batch, target.append_batch = fold, append_batch
    assert rebuild_from_events(events, target, batch=4)[0] == len(events) - 1
    assert live_batches and live_batches[0][0] == events[4][0].id  # the failed batch, again on the live path
    assert diff(projections, rebuilt) == []


def committed(engine, event_id: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with engine.connect() as conn:
            if conn.execute(select(tables.events.c.id).where(tables.events.c.id == event_id)).first() is not None:
                return
        assert time.monotonic() < deadline, f"event {event_id} never committed"
        time.sleep(0.01)


@pytest.mark.postgres
def test_a_failed_write_behind_the_fold_is_raised_and_nothing_is_left_running(live, tmp_path):
    live_store, _projections = live
    with scratch_pg_database() as url:
        failed_write_is_raised(live_store, *fresh(tmp_path, "rebuilt.db", url))


def failed_write_is_raised(live_store, target, _rebuilt):
    real_run, runs = DeferredWrites.run, []

    def run(self, conn):
        runs.append(threading.current_thread().name)
        if len(runs) == 3:
            raise OSError("disk gone")
        return real_run(self, conn)

    DeferredWrites.run = run
    try:
        with pytest.raises(OSError, match="disk gone"):
            rebuild(live_store, target, batch=4)
    finally:
        DeferredWrites.run = real_run
    assert runs[0] == "rebuild-writer"  # the writes did run behind, on their own thread
    assert not [t for t in threading.enumerate() if t.name == "rebuild-writer"]
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with target.engine.connect() as conn:  # the two batches before the failure, whole
        assert conn.execute(select(tables.events.c.id)).scalars().all() == [
            e.id for _, e, _d in live_store.read_with_dedup(0, 8)
        ]


@pytest.mark.postgres
def test_from_postgresql_the_next_chunk_is_fetched_ahead_and_a_failure_on_either_side_stops_it(tmp_path, pg_url):
    live_store, projections = fresh(tmp_path, "live.db", pg_url)
    history(live_store)
    steps(live_store, 4)
    real_fetch, fetched_by = live_store.fetch_packed, []

    def fetch(*args):
        fetched_by.append(threading.current_thread().name)
        return real_fetch(*args)

    live_store.fetch_packed = fetch
    target, rebuilt = fresh(tmp_path, "rebuilt.db")
    assert rebuild(live_store, target, batch=4)[0] == 30
    assert set(fetched_by) == {"replay-fetcher"} and len(fetched_by) == 9  # 8 chunks and the empty end
    assert diff(projections, rebuilt) == []

    def broken_fetch(*args):  # the source fails on its third chunk: the error comes out of rebuild
        if len(fetched_by) == 11:
            raise OSError("source gone")
        return fetch(*args)

    live_store.fetch_packed = broken_fetch
    with pytest.raises(OSError, match="source gone"):
        rebuild(live_store, fresh(tmp_path, "second.db")[0], batch=4)
    third, _ = fresh(tmp_path, "third.db")
    third.rebuilder = lambda: FailingRebuilder(third)  # the fold fails on its second chunk
    live_store.fetch_packed = fetch
    with pytest.raises(RuntimeError, match="fold failed"):
        rebuild(live_store, third, batch=4)
    assert not [t for t in threading.enumerate() if t.name == "replay-fetcher"]


class FailingRebuilder:
    def __init__(self, store):
        self.real, self.calls = store.__class__.rebuilder(store), 0

    def append(self, events, packed=None):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("fold failed")
        return self.real.append(events, packed)

    def close(self):
        self.real.close()


@pytest.mark.postgres
def test_copy_rows_go_as_utf8_whatever_the_targets_client_encoding(tmp_path):
    """A rebuild formats its COPY rows on one thread while another sends the last batch, so
    it encodes text itself, as UTF-8, and sets its connection to match."""
    from openrl_core.events import sessions as se

    with scratch_pg_database() as live_url, scratch_pg_database() as target_url:
        live_store, projections = fresh(tmp_path, "live.db", live_url)
        created = se.SessionCreated(
            session_id="s9", tags=["ünïcødé"], user_metadata={"k": "éàç"}, display_name="ünïcødé, tab\there \\ ñ"
        )
        live_store.append(new_event(se.SESSION_CREATED, created, tenant="alice", source="/t"))
        history(live_store)
        target, rebuilt = fresh(tmp_path, "rebuilt.db", target_url + "?client_encoding=latin1")
        assert rebuild(live_store, target, batch=4)[0] == 15
        assert diff(projections, rebuilt) == []
        [row] = [r for r in rebuilt.table_rows("sessions") if r["session_id"] == "s9"]
        assert row["display_name"] == "ünïcødé, tab\there \\ ñ" and row["tags"] == [
            "ünïcødé"
        ]  # a text column, and JSON
        target.engine.dispose()
        live_store.engine.dispose()


def test_into_a_sqlite_file_the_writes_go_to_a_process_of_their_own(live, tmp_path, monkeypatch):
    """Every batch is sent to the writer process, none is written on a connection here, and
    the process has ended once the rebuild returns."""
    live_store, projections = live
    target, rebuilt = fresh(tmp_path, "rebuilt.db")
    writers, sent, ran_here = [], [], []
    real_init, real_send = SqliteWriter.__init__, SqliteWriter.send

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        writers.append(self)

    def send(self, statements):
        sent.append(len(statements))
        return real_send(self, statements)

    monkeypatch.setattr(SqliteWriter, "__init__", init)
    monkeypatch.setattr(SqliteWriter, "send", send)
    monkeypatch.setattr(DeferredWrites, "run", lambda self, conn: ran_here.append(1))
    assert rebuild(live_store, target, batch=4)[0] == 30
    assert len(writers) == 1 and len(sent) == 8 and all(sent) and not ran_here  # 30 events in batches of 4
    assert writers[0]._process.returncode == 0
    assert diff(projections, rebuilt) == []


def test_a_killed_sqlite_writer_is_raised_and_the_batches_before_it_stay_whole(live, tmp_path, monkeypatch):
    live_store, _projections = live
    target, _rebuilt = fresh(tmp_path, "rebuilt.db")
    real_send, writers = SqliteWriter.send, []

    def send(self, statements):
        writers.append(self)
        if len(writers) == 3:  # the writer dies before the third batch reaches it
            self._process.kill()
            self._process.wait()
        return real_send(self, statements)

    monkeypatch.setattr(SqliteWriter, "send", send)
    with pytest.raises(RuntimeError, match="exited with code -9"):
        rebuild(live_store, target, batch=4)
    assert writers[0]._process.returncode == -9
    assert writers[0]._process.stdin.closed and writers[0]._process.stdout.closed  # ended, its pipes too
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with target.engine.connect() as conn:  # the two batches before the failure, whole
        written = conn.execute(select(tables.events.c.id).order_by(tables.events.c.position)).scalars().all()
    assert written == [e.id for _, e, _d in live_store.read_with_dedup(0, 8)]


def test_into_sqlite_in_memory_the_writes_stay_in_this_process(live, tmp_path, monkeypatch):
    live_store, projections = live
    engine = create_engine("sqlite://", poolclass=StaticPool, connect_args={"check_same_thread": False})
    database.upgrade(engine)
    target = EventStore(engine, Codec(BlobStore(tmp_path / "memory-blobs")))
    monkeypatch.setattr(SqliteWriter, "__init__", lambda *a, **k: pytest.fail("no file for a writer process to open"))
    assert rebuild(live_store, target, batch=4)[0] == 30
    assert diff(projections, Projections(engine)) == []
