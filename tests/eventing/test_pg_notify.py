"""Wake-ups across processes through PostgreSQL LISTEN/NOTIFY (the distributed long-poll)."""

from __future__ import annotations

import json
import queue
from types import SimpleNamespace

import pytest

from eventing.pg_notify import PgNotifier, chunks, row_pieces

pytestmark = pytest.mark.postgres


def test_a_notification_reaches_every_subscriber_of_another_connection(pg_url):
    sender, receiver = PgNotifier(pg_url), PgNotifier(pg_url)
    got: queue.Queue = queue.Queue()
    receiver.subscribe(got.put)
    try:
        ids = [f"req-{i:040d}" for i in range(400)]  # over the 8000-byte NOTIFY payload limit
        sender.notify(ids)
        received = []
        while len(received) < len(ids):
            received += got.get(timeout=5)
        assert received == ids
    finally:
        sender.close()
        receiver.close()


def test_chunks_stay_under_the_payload_limit():
    ids = [f"req-{i:060d}" for i in range(300)]
    pieces = chunks(ids)
    assert len(pieces) > 1 and all(len(p) <= 7900 for p in pieces)
    assert [i for p in pieces for i in p.split(",")] == ids


def test_finished_rows_arrive_before_their_ids_and_big_ones_go_by_id_alone(pg_url):
    sender, receiver = PgNotifier(pg_url), PgNotifier(pg_url)
    heard: queue.Queue = queue.Queue()
    receiver.subscribe(lambda ids: heard.put(("ids", ids)), on_rows=lambda rows: heard.put(("rows", rows)))
    small = [SimpleNamespace(request_id=f"req-{i}", tenant="alice", kind="optim_step", model_id="m", state="completed",
                             result={"metrics": {"loss": 0.5 + i}}, error=None, category=None, created_at="not sent")
             for i in range(60)]  # fmt: skip
    big = SimpleNamespace(request_id="req-big", tenant="alice", kind="forward_backward", model_id="m", state="completed",
                          result={"logprobs": [0.125] * 2000}, error=None, category=None)  # fmt: skip
    try:
        ids = [row.request_id for row in small] + ["req-big", "req-running"]
        sender.notify(ids, rows=small + [big])
        got, rows = [], []
        while len(got) < len(ids):
            kind, value = heard.get(timeout=5)
            if kind == "rows":
                assert not got  # every row piece before the first id
                rows += value
            else:
                got += value
        assert got == ids
        # The fields the gateway answers from, as sent; the big row is left to a store read.
        assert rows == [{"request_id": r.request_id, "tenant": "alice", "kind": "optim_step", "model_id": "m", "state": "completed",
                         "result": r.result, "error": None, "category": None} for r in small]  # fmt: skip
    finally:
        sender.close()
        receiver.close()


def test_row_pieces_stay_under_the_payload_limit_and_read_back():
    rows = [SimpleNamespace(request_id=f"req-{i:040d}", tenant="t", kind="optim_step", model_id="m", state="failed",
                            result=None, error="x" * 300, category="user") for i in range(100)]  # fmt: skip
    pieces = row_pieces(rows)
    assert len(pieces) > 1 and all(len(p) <= 7900 for p in pieces)
    assert [row["request_id"] for p in pieces for row in json.loads(p)["rows"]] == [r.request_id for r in rows]


def test_a_listener_of_ids_alone_is_not_handed_rows(pg_url):
    """A subscriber without on_rows (an older gateway's way) still gets exactly the ids."""
    sender, receiver = PgNotifier(pg_url), PgNotifier(pg_url)
    got: queue.Queue = queue.Queue()
    receiver.subscribe(got.put)
    row = SimpleNamespace(
        request_id="req-1",
        tenant="t",
        kind="optim_step",
        model_id="m",
        state="completed",
        result={},
        error=None,
        category=None,
    )
    try:
        sender.notify(["req-1"], rows=[row])
        assert got.get(timeout=5) == ["req-1"]
        with pytest.raises(queue.Empty):
            got.get(timeout=0.3)
    finally:
        sender.close()
        receiver.close()


def test_a_store_announces_the_runs_its_committed_transactions_changed(pg_url, tmp_path):
    """With `announce_runs`, a transaction that changes a run sends its id with a NOTIFY of
    its own, delivered once it commits; one that only moves `last_request_time` (every
    request) sends none, and neither does a transaction that failed (nothing changed)."""
    from eventing.blobs import BlobStore
    from eventing.codec import Codec
    from eventing.store import database
    from eventing.store.event_store import Dedup, EventStore
    from openrl_core.errors import Conflict
    from openrl_core.events import training as te
    from openrl_core.params import AdamParams
    from tests.eventing.test_event_store import create_model, ev, session

    engine = database.make_engine(pg_url)
    database.upgrade(engine)
    store = EventStore(engine, Codec(BlobStore(tmp_path / "blobs")))
    store.announce_runs()
    receiver = PgNotifier(pg_url)
    runs: queue.Queue = queue.Queue()
    receiver.subscribe(lambda ids: None, on_runs=runs.put)
    try:
        session(store)
        assert runs.empty()  # a session is no run
        create_model(store)  # the run's row is made
        assert runs.get(timeout=5) == ["s1:train:0"]
        step = te.OptimStepRequested(request_id="o1", model_id="s1:train:0", seq_id=1, adam_params=AdamParams())
        store.append(
            ev(te.OPTIM_STEP["requested"], step), dedup=Dedup.of("seq:s1:train:0:1", b"a")
        )  # last_request_time only
        with pytest.raises(Conflict):  # refused before it changed anything: nothing committed
            store.append(
                ev(te.OPTIM_STEP["requested"], step.model_copy(update={"request_id": "o2"})),
                dedup=Dedup.of("seq:s1:train:0:1", b"b"),
            )
        store.append(ev(te.RUN_CANCELLED, te.RunCancelled(model_id="s1:train:0")))
        assert runs.get(timeout=5) == ["s1:train:0"]  # the cancel's, and nothing before it
        with pytest.raises(queue.Empty):
            runs.get(timeout=0.3)
    finally:
        receiver.close()
        engine.dispose()


def test_run_pieces_stay_under_the_payload_limit_and_read_back():
    from eventing.pg_notify import run_pieces

    ids = [f"{i:036d}:train:{i}" for i in range(400)]
    pieces = run_pieces(ids)
    assert len(pieces) > 1 and all(len(p) <= 7900 for p in pieces)
    assert [run for p in pieces for run in json.loads(p)["runs"]] == ids
