"""The event store on SQLite and PostgreSQL: idempotency, dedup, projections, outbox."""

from __future__ import annotations

import numpy as np
import pytest

from eventing.store.event_store import Dedup
from openrl_core.datum import Datum, DatumRecord
from openrl_core.errors import Conflict
from openrl_core.events import new_event
from openrl_core.events import sessions as se
from openrl_core.events import training as te
from openrl_core.events.lifecycle import BlobRef, CheckpointSaved, RequestCompleted, RequestFailed
from openrl_core.params import AdamParams, LoraConfig

T = "alice"


def ev(type_, payload, tenant=T, key=None):
    return new_event(type_, payload, tenant=tenant, source="/test", key=key)


def session(store, sid="s1", tenant=T):
    store.append(ev(se.SESSION_CREATED, se.SessionCreated(session_id=sid), tenant))


def create_model(store, sid="s1", n=0, tenant=T, request_id="req-create"):
    payload = te.CreateModelRequested(
        request_id=request_id, session_id=sid, model_id=f"{sid}:train:{n}", model_seq_id=n,
        base_model="openrl/tiny-qwen3", lora_config=LoraConfig(rank=4),
    )  # fmt: skip
    return store.append(ev(te.CREATE_MODEL["requested"], payload, tenant), dedup=Dedup.of(f"model:{sid}:{n}", b"body"))


def test_an_event_is_stored_once(store):
    store, _ = store
    event = ev(se.SESSION_CREATED, se.SessionCreated(session_id="s1"))
    assert store.append(event).stored
    assert not store.append(event).stored  # a redelivery
    assert [e.id for _, e in store.read()] == [event.id]


def test_projection_of_a_model_lifecycle(store):
    store, reads = store
    session(store)
    create_model(store)
    run = reads.run(T, "s1:train:0")
    assert run.state == "creating" and run.lora_rank == 4
    assert reads.future(T, "req-create").state == "pending"
    done = RequestCompleted(request_id="req-create", result={"model_id": "s1:train:0", "type": "create_model"})
    store.append(ev(te.CREATE_MODEL["completed"], done))
    assert reads.run(T, "s1:train:0").state == "ready"
    future = reads.future(T, "req-create")
    assert future.state == "completed" and future.result["model_id"] == "s1:train:0"
    # a late failure for a finished future changes nothing
    store.append(ev(te.CREATE_MODEL["failed"], RequestFailed(request_id="req-create", error="late")))
    assert reads.future(T, "req-create").state == "completed"


def test_a_retried_submission_returns_the_first_future_and_another_body_conflicts(store):
    store, reads = store
    session(store)
    assert create_model(store).stored
    again = create_model(store, request_id="req-retry")
    assert again.duplicate_of == "req-create" and not again.stored
    assert reads.future(T, "req-retry") is None
    payload = te.OptimStepRequested(request_id="r2", model_id="s1:train:0", seq_id=1, adam_params=AdamParams())
    with pytest.raises(Conflict):
        store.append(ev(te.OPTIM_STEP["requested"], payload), dedup=Dedup.of("model:s1:0", b"other body"))


def test_a_refused_seq_id_stays_used(store):
    store, _ = store
    refused = Dedup.of("seq:s1:train:0:5", b"bad").refused()
    skipped = te.SeqSkipped(model_id="s1:train:0", seq_id=5, reason="bad input")
    assert store.append(ev(te.SEQ_SKIPPED, skipped), dedup=refused).stored
    again = store.append(ev(te.SEQ_SKIPPED, skipped), dedup=refused)  # the same refused request again
    assert not again.stored
    payload = te.OptimStepRequested(request_id="r5", model_id="s1:train:0", seq_id=5, adam_params=AdamParams())
    with pytest.raises(Conflict, match="refused"):
        store.append(ev(te.OPTIM_STEP["requested"], payload), dedup=Dedup.of("seq:s1:train:0:5", b"good"))


def test_tenants_do_not_see_each_other(store):
    store, reads = store
    session(store, "s1", "alice")
    create_model(store, "s1", tenant="alice")
    assert reads.session("bob", "s1") is None
    assert reads.run("bob", "s1:train:0") is None
    assert reads.future("bob", "req-create") is None
    assert reads.run("alice", "s1:train:0") is not None


def test_checkpoints_and_outbox(store):
    store, reads = store
    session(store)
    create_model(store)
    save = te.SaveWeightsRequested(request_id="req-save", model_id="s1:train:0", seq_id=1, name="final")
    dedup = Dedup.of("seq:s1:train:0:1", b"save")
    store.append(ev(te.SAVE_WEIGHTS["requested"], save), outbox_topic="openrl.alice.training", dedup=dedup)
    pending = store.unpublished()
    assert [(e.id, topic, d) for e, topic, d in pending] == [(pending[0][0].id, "openrl.alice.training", dedup)]
    store.mark_published(pending[0][0].id)
    assert store.unpublished() == []
    ref = BlobRef(sha256="a" * 64, size=10)
    checkpoint = CheckpointSaved(
        run_id="s1:train:0", kind="weights", name="final", files={"adapter_model.safetensors": ref}
    )
    done = RequestCompleted(request_id="req-save", result={"path": checkpoint.tinker_path}, checkpoint=checkpoint)
    store.append(ev(te.SAVE_WEIGHTS["completed"], done))
    row = reads.checkpoint(T, "s1:train:0", "weights/final")
    assert row.tinker_path == "tinker://s1:train:0/weights/final" and row.size_bytes == 10
    assert reads.run(T, "s1:train:0").last_checkpoint == "weights/final"
    assert reads.checkpoint("bob", "s1:train:0", "weights/final") is None


def test_large_payloads_are_stored_by_reference_and_read_back(store):
    store, _ = store
    datum = Datum(np.arange(3000, dtype=np.int64), {"target_tokens": np.arange(3000, dtype=np.int64)})
    payload = te.ForwardBackwardRequested(
        request_id="req-big",
        model_id="s1:train:0",
        seq_id=1,
        loss_fn="cross_entropy",
        data=[DatumRecord.from_datum(datum)],
    )
    event = ev(te.FORWARD_BACKWARD["requested"], payload)
    store.append(event)
    [(_, back)] = store.read()
    assert back == event


def test_a_batch_appends_in_one_go_and_a_redelivered_one_stores_only_what_is_new(store):
    store, reads = store
    created = ev(se.SESSION_CREATED, se.SessionCreated(session_id="s1"))
    payload = te.CreateModelRequested(
        request_id="req-create", session_id="s1", model_id="s1:train:0", model_seq_id=0,
        base_model="openrl/tiny-qwen3", lora_config=LoraConfig(rank=4),
    )  # fmt: skip
    requested = ev(te.CREATE_MODEL["requested"], payload)
    dedup = Dedup.of("model:s1:0", b"body")
    assert store.append_batch([(created, None), (requested, dedup)]) == 2
    assert reads.run(T, "s1:train:0").state == "creating"  # folded inside the batch, in order
    done = ev(
        te.CREATE_MODEL["completed"], RequestCompleted(request_id="req-create", result={"model_id": "s1:train:0"})
    )
    # The first two again (a redelivery): the batch falls back to one by one and adds only `done`.
    assert store.append_batch([(created, None), (requested, dedup), (done, None)]) == 1
    assert [e.id for _, e in store.read()] == [created.id, requested.id, done.id]
    assert reads.future(T, "req-create").state == "completed"


def test_a_conflicting_submission_rolls_the_whole_batch_back(store):
    store, _ = store
    session(store)
    create_model(store)
    other = ev(se.SESSION_CREATED, se.SessionCreated(session_id="s2"))
    payload = te.OptimStepRequested(request_id="r2", model_id="s1:train:0", seq_id=1, adam_params=AdamParams())
    with pytest.raises(Conflict):
        store.append_batch(
            [(other, None), (ev(te.OPTIM_STEP["requested"], payload), Dedup.of("model:s1:0", b"other body"))]
        )
    assert not store.contains(other.id)


def test_an_event_under_a_fenced_lease_is_kept_but_never_applied(store, tmp_path):
    """Per model, leases only grow: a completion carrying a lease below one already applied
    comes from a holder that lost the device (paused, replaced) and changes nothing."""
    from eventing.replay import replay
    from eventing.store import database
    from eventing.store.event_store import EventStore
    from eventing.store.queries import Projections

    store, reads = store
    session(store)
    create_model(store)
    model = "s1:train:0"
    fb = te.ForwardBackwardRequested(request_id="fb1", model_id=model, seq_id=1, loss_fn="cross_entropy", data=[])
    store.append(ev(te.FORWARD_BACKWARD["requested"], fb, key=model))
    fresh = RequestCompleted(request_id="req-create", result={"model_id": model, "type": "create_model"})
    applied = store.append(new_event(te.CREATE_MODEL["completed"], fresh, tenant=T, source="/t", key=model, lease=700))
    assert applied.stored and not applied.fenced
    stale = RequestCompleted(request_id="fb1", result={"metrics": {"loss:sum": 1.0}})
    refused = store.append(
        new_event(te.FORWARD_BACKWARD["completed"], stale, tenant=T, source="/t", key=model, lease=500)
    )
    assert refused.stored and refused.fenced
    assert reads.future(T, "fb1").state == "pending", "the stale completion projected nothing"
    same = store.append(new_event(te.FORWARD_BACKWARD["completed"], stale, tenant=T, source="/t", key=model, lease=700))
    assert same.stored and not same.fenced and reads.future(T, "fb1").state == "completed"
    other_key = store.append(
        new_event(te.FORWARD_BACKWARD["completed"], stale, tenant=T, source="/t", key="s1:train:9", lease=1)
    )
    assert not other_key.fenced, "fences are per model"
    kept = [(e.lease, e.type.split(".")[-2]) for _, e in store.read() if e.lease is not None]
    assert kept == [(700, "completed"), (500, "completed"), (700, "completed"), (1, "completed")]
    # a replay refuses exactly what the live store refused
    engine = database.make_engine(f"sqlite:///{tmp_path}/replayed.db")
    database.upgrade(engine)
    report = replay(store, reads, EventStore(engine, store.codec), Projections(engine))
    assert report.differences == []
    engine.dispose()


def test_append_many_answers_each_submission_on_its_own_in_one_transaction(store):
    """The appender's batch: a fresh submission is stored, a retry answers its first future,
    a reused seq_id with another body is that item's Conflict, and its neighbours are kept."""
    store, reads = store
    session(store)
    create_model(store)
    first = te.OptimStepRequested(request_id="r1", model_id="s1:train:0", seq_id=1, adam_params=AdamParams())
    retry = te.OptimStepRequested(request_id="r1-again", model_id="s1:train:0", seq_id=1, adam_params=AdamParams())
    clash = te.OptimStepRequested(request_id="r-clash", model_id="s1:train:0", seq_id=1, adam_params=AdamParams())
    second = te.OptimStepRequested(request_id="r2", model_id="s1:train:0", seq_id=2, adam_params=AdamParams())
    seq = lambda n: f"seq:s1:train:0:{n}"  # noqa: E731
    outcomes = store.append_many([
        (ev(te.OPTIM_STEP["requested"], first), "openrl.alice.training", Dedup.of(seq(1), b"a")),
        (ev(te.OPTIM_STEP["requested"], retry), "openrl.alice.training", Dedup.of(seq(1), b"a")),  # same body, same batch
        (ev(te.OPTIM_STEP["requested"], clash), "openrl.alice.training", Dedup.of(seq(1), b"b")),
        (ev(te.OPTIM_STEP["requested"], second), "openrl.alice.training", Dedup.of(seq(2), b"c")),
    ])  # fmt: skip
    assert outcomes[0].stored and outcomes[3].stored
    assert not outcomes[1].stored and outcomes[1].duplicate_of == "r1"
    assert isinstance(outcomes[2], Conflict) and "different body" in str(outcomes[2])
    assert reads.future(T, "r1").state == "pending" and reads.future(T, "r2").state == "pending"
    assert reads.future(T, "r1-again") is None and reads.future(T, "r-clash") is None
    assert sorted(e.data.request_id for e, _topic, _dedup in store.unpublished()) == ["r1", "r2"]
    store.mark_published_many([e.id for e, _topic, _dedup in store.unpublished()])
    assert store.unpublished() == []


def test_append_many_falls_back_to_one_by_one_when_the_batch_breaks(store):
    """An event id already stored (a redelivery) breaks the batch's transaction: every item
    is then appended alone and gets its own answer."""
    store, reads = store
    created = ev(se.SESSION_CREATED, se.SessionCreated(session_id="s1"))
    assert store.append(created).stored
    other = ev(se.SESSION_CREATED, se.SessionCreated(session_id="s2"))
    outcomes = store.append_many([(created, None, None), (other, None, None)])
    assert [o.stored for o in outcomes] == [False, True]
    assert reads.session(T, "s2") is not None


def test_read_packed_reads_what_the_sqlalchemy_rows_hold(store):
    """Replay's reader takes the driver's tuples; every field, the dedup identity and the
    payload as stored must be what the SQLAlchemy row of the same event says."""
    from sqlalchemy import select

    from eventing.store import tables

    store, _ = store
    session(store)
    create_model(store)
    big = Datum(np.arange(3000, dtype=np.int64), {"target_tokens": np.arange(3000, dtype=np.int64)})
    fb = te.ForwardBackwardRequested(
        request_id="fb1", model_id="s1:train:0", seq_id=1, loss_fn="cross_entropy", data=[DatumRecord.from_datum(big)]
    )
    store.append(ev(te.FORWARD_BACKWARD["requested"], fb, key="s1:train:0"), dedup=Dedup.of("seq:s1:train:0:1", b"fb"))
    skipped = te.SeqSkipped(model_id="s1:train:0", seq_id=2, reason="bad")
    store.append(ev(te.SEQ_SKIPPED, skipped, key="s1:train:0"), dedup=Dedup.of("seq:s1:train:0:2", b"x").refused())
    done = RequestCompleted(request_id="fb1", result={"metrics": {"loss:sum": 1.25}}, details={"tokens": 8})
    store.append(new_event(te.FORWARD_BACKWARD["completed"], done, tenant=T, source="/t", key="s1:train:0", lease=7))
    with store.engine.connect() as conn:
        rows = {row.id: row for row in conn.execute(select(tables.events))}
    packed = store.read_packed(0, 100) + store.read_packed(2, 1)  # and from a position, with a limit
    assert [event.id for _p, event, _d, _s in packed[:-1]] == list(rows) and packed[-1][0] == 3
    assert any(row.claim_sha256 for row in rows.values()) and any(row.dedup_rejected for row in rows.values())
    for position, event, dedup, (data, claim) in packed:
        row = rows[event.id]
        assert position == row.position
        assert event == store.event_of(row) and event.time.tzinfo is not None
        assert event.time == row.time.replace(tzinfo=event.time.tzinfo) and event.lease == row.lease_id
        expected = Dedup(row.dedup_key, row.dedup_sha256, bool(row.dedup_rejected)) if row.dedup_key else None
        assert dedup == expected
        assert data == bytes(row.data or b"") and (claim.sha256 if claim else None) == row.claim_sha256


def test_the_outbox_is_read_in_log_order(store):
    """`unpublished` gives the outbox's events in the order they were stored, each with its
    topic, past one IN list's 500 ids (its events are read by id since it stopped walking
    every event: tests/eventing/test_read_plans.py)."""
    store, _ = store
    for n in range(30):  # published long ago: in the store, not in the outbox
        session(store, f"old{n}")
    topics = [f"openrl.alice.training.{n % 3}" for n in range(620)]
    appended = []
    for start in range(0, len(topics), 100):
        batch = [
            (ev(se.SESSION_CREATED, se.SessionCreated(session_id=f"s{n}")), topics[n], None)
            for n in range(start, min(start + 100, len(topics)))
        ]
        store.append_many(batch)
        appended += [(event.id, topic) for event, topic, _dedup in batch]
    store.mark_published_many([event_id for event_id, _topic in appended[::7]])
    left = [pair for index, pair in enumerate(appended) if index % 7]
    assert [(event.id, topic) for event, topic, _dedup in store.unpublished()] == left
