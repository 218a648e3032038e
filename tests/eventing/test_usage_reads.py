"""The AdminClient's store reads on SQLite and PostgreSQL: hourly token sums from the futures,
stored intervals of live and removed checkpoints, storage by project, the day's audit events,
and nothing of another tenant's. Events are appended at chosen times, as the projector would."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np

from eventing.replay import replay
from eventing.store import database, usage_reads
from eventing.store.event_store import EventStore
from eventing.store.queries import Projections
from openrl_core import audit_log
from openrl_core.billing import buckets
from openrl_core.datum import Datum, DatumRecord
from openrl_core.events import checkpoints as ce
from openrl_core.events import new_event
from openrl_core.events import sampling as sa
from openrl_core.events import sessions as se
from openrl_core.events import training as te
from openrl_core.events.lifecycle import BlobRef, CheckpointSaved, RequestCompleted, RequestFailed
from openrl_core.params import LoraConfig, SamplingParams

T0 = datetime(2026, 7, 13, tzinfo=timezone.utc)
RUN, SAMPLER = "s1:train:0", "s1:sample:0"


def at(hours: float) -> datetime:
    return T0 + timedelta(hours=hours)


def put(store, type_, payload, hours, tenant="alice", key=RUN):
    event = new_event(type_, payload, tenant=tenant, source="/test", key=key, subject="x")
    store.append(event.model_copy(update={"time": at(hours)}))
    return event


def fb(request_id, lengths, forward_only=False):
    data = [DatumRecord.from_datum(Datum(np.arange(n, dtype=np.int64), {})) for n in lengths]
    return te.ForwardBackwardRequested(request_id=request_id, model_id=RUN, seq_id=1, loss_fn="cross_entropy",
                                       forward_only=forward_only, data=data)  # fmt: skip


def sample(request_id, prompt, n=2):
    return sa.SampleRequested(request_id=request_id, sampling_session_id=SAMPLER, seq_id=0, base_model="m",
                              prompt_tokens=list(range(prompt)), num_samples=n, sampling_params=SamplingParams(max_tokens=8),
                              sample_sequence_ids=[f"{request_id}:{i}" for i in range(n)])  # fmt: skip


def done(request_id, result=None):
    return RequestCompleted(request_id=request_id, result=result or {})


def saved(name, size, request_id):
    files = {"a": BlobRef(sha256=f"{abs(hash(name)) % 10**8:064d}", size=size)}
    checkpoint = CheckpointSaved(run_id=RUN, kind="weights", name=name, files=files)
    return RequestCompleted(request_id=request_id, result={}, checkpoint=checkpoint)


def world(store, tenant="alice"):
    """A session in project p1 with a run and a sampler, used across hours 0-3."""
    meta = {"team": "rl"}
    put(
        store,
        se.SESSION_CREATED,
        se.SessionCreated(session_id="s1", project_id="p1", user_metadata=meta),
        0,
        tenant,
        "s1",
    )
    create = te.CreateModelRequested(request_id="c", session_id="s1", model_id=RUN, model_seq_id=0, base_model="m",
                                     lora_config=LoraConfig(rank=4))  # fmt: skip
    put(store, te.CREATE_MODEL["requested"], create, 0, tenant)
    put(store, te.CREATE_MODEL["completed"], done("c"), 0, tenant)
    created = sa.SamplingSessionCreated(
        sampling_session_id=SAMPLER, session_id="s1", sampling_session_seq_id=0, base_model="m"
    )
    put(store, sa.SAMPLING_SESSION_CREATED, created, 0, tenant, SAMPLER)
    put(store, te.FORWARD_BACKWARD["requested"], fb("f1", [5, 7]), 0.1, tenant)
    put(store, te.FORWARD_BACKWARD["completed"], done("f1"), 0.2, tenant)
    put(store, te.FORWARD_BACKWARD["requested"], fb("f2", [3], forward_only=True), 0.9, tenant)
    put(store, te.FORWARD_BACKWARD["completed"], done("f2"), 1.1, tenant)  # counts in the hour it completed
    put(store, te.FORWARD_BACKWARD["requested"], fb("f3", [100]), 1.2, tenant)
    put(store, te.FORWARD_BACKWARD["failed"], RequestFailed(request_id="f3", error="x"), 1.3, tenant)  # free
    put(store, sa.SAMPLE["requested"], sample("q1", 4), 1.4, tenant, SAMPLER)
    result = {"sequences": [{"tokens": [1, 2, 3]}, {"tokens": [4]}]}
    put(store, sa.SAMPLE["completed"], done("q1", result), 1.5, tenant, SAMPLER)
    put(
        store,
        te.SAVE_WEIGHTS["requested"],
        te.SaveWeightsRequested(request_id="w1", model_id=RUN, seq_id=2, name="a"),
        0.5,
        tenant,
    )
    put(store, te.SAVE_WEIGHTS["completed"], saved("a", 2 * 10**9, "w1"), 0.5, tenant)
    put(
        store,
        te.SAVE_WEIGHTS["requested"],
        te.SaveWeightsRequested(request_id="w2", model_id=RUN, seq_id=3, name="b"),
        1.0,
        tenant,
    )
    put(store, te.SAVE_WEIGHTS["completed"], saved("b", 10**9, "w2"), 1.0, tenant)
    removed = ce.CheckpointRemoved(
        run_id=RUN, checkpoint_id="weights/a", files=saved("a", 2 * 10**9, "w1").checkpoint.files
    )
    put(store, ce.CHECKPOINT_DELETED, removed, 1.5, tenant)
    put(
        store,
        se.SESSION_PROJECT_ASSIGNED,
        se.SessionProjectAssigned(session_id="s1", project_id="p2"),
        2.5,
        tenant,
        "s1",
    )


def test_usage_by_hour_storage_by_project_and_audit_of_one_tenant(store, tmp_path):
    store, live = store
    world(store)
    engine = store.engine
    tokens = usage_reads.token_rows(engine, "alice", at(0), at(3))
    stored = usage_reads.stored_rows(engine, "alice", at(0), at(3))
    events = buckets(at(0), at(3), at(3), tokens, stored)
    got = {(e["bucket_start"], e["event_info"]["type"]): e for e in events}
    h0, h1, h2 = (at(h).isoformat() for h in range(3))
    assert got[(h0, "training")]["event_info"]["token_count"] == 12
    assert got[(h1, "training")]["event_info"]["token_count"] == 3  # the forward-only one; the failed one is free
    assert got[(h1, "sampling_prefill")]["event_info"]["token_count"] == 4
    assert got[(h1, "sampling_sample")]["event_info"]["token_count"] == 4
    assert got[(h0, "checkpoint")]["event_info"]["count"] == 1 and got[(h1, "checkpoint")]["event_info"]["count"] == 1
    # a: 2 GB from 00:30 to its deletion at 01:30; b: 1 GB from 01:00 on.
    gbh = {k[0]: e["event_info"]["gigabyte_hours"] for k, e in got.items() if k[1] == "storage"}
    assert gbh == {h0: 1.0, h1: 1.0 + 1.0, h2: 1.0}
    assert {e["project_id"] for e in events} == {"p2"}  # the session's current project
    assert {e["base_model"] for e in events} == {"m"} and {e["session_id"] for e in events} == {"s1"}
    assert usage_reads.session_metadata(engine, "alice", ["s1"]) == {"s1": {"team": "rl"}}
    # The billing route's single read (one connection) is the three reads above.
    assert usage_reads.usage(engine, "alice", at(0), at(3)) == (tokens, stored, {"s1": {"team": "rl"}})

    now = at(3)
    assert usage_reads.current_storage(engine, "alice", now, None) == [("p2", 1, 10**9)]
    assert usage_reads.current_storage(engine, "alice", now, "p1") == []

    day = audit_log.source_types("checkpoints")
    found, cut = usage_reads.audit_events(store, "alice", day, *audit_log.day_window(T0.date()), limit=10)
    names = [entry["event"] for e in found if (entry := audit_log.entry(e, "checkpoints"))]
    assert names == ["checkpoint_saved", "checkpoint_saved", "checkpoint_deleted"] and not cut
    few, cut = usage_reads.audit_events(store, "alice", day, *audit_log.day_window(T0.date()), limit=2)
    assert len(few) == 2 and cut
    tomorrow = audit_log.day_window((T0 + timedelta(days=1)).date())
    assert usage_reads.audit_events(store, "alice", day, *tomorrow, limit=10) == ([], False)

    for tenant in ("bob",):  # another tenant sees none of it
        assert usage_reads.token_rows(engine, tenant, at(0), at(3)) == []
        assert usage_reads.stored_rows(engine, tenant, at(0), at(3)) == []
        assert usage_reads.current_storage(engine, tenant, now, None) == []
        assert usage_reads.audit_events(store, tenant, day, *audit_log.day_window(T0.date()), limit=10) == ([], False)

    # The new columns and table are projections: a replay rebuilds them exactly.
    target_engine = database.make_engine(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    database.upgrade(target_engine)
    report = replay(store, live, EventStore(target_engine, store.codec), Projections(target_engine))
    assert report.differences == []
    target_engine.dispose()


def test_a_replaced_checkpoint_keeps_its_first_interval(store):
    store, _ = store
    world(store)
    again = te.SaveWeightsRequested(request_id="w3", model_id=RUN, seq_id=4, name="b")
    put(store, te.SAVE_WEIGHTS["requested"], again, 2.0)
    put(store, te.SAVE_WEIGHTS["completed"], saved("b", 3 * 10**9, "w3"), 2.0)
    stored = usage_reads.stored_rows(store.engine, "alice", at(0), at(3))
    assert sorted((r.saved_at, r.removed_at, r.size_bytes) for r in stored) == [
        (at(0.5), at(1.5), 2 * 10**9), (at(1.0), at(2.0), 10**9), (at(2.0), None, 3 * 10**9),
    ]  # fmt: skip
