"""Replay rebuilds every projection from the events alone; the diff proves it and catches
any row that was changed behind the events' back."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from eventing import topics
from eventing.blobs import BlobStore
from eventing.bus import EventPublisher
from eventing.codec import Codec
from eventing.embedded_log import EmbeddedLog
from eventing.replay import diff, read_log, rebuild_from_events, replay
from eventing.store import database, tables
from eventing.store.event_store import Dedup, EventStore
from eventing.store.queries import Projections
from openrl_core.events import new_event
from openrl_core.events import sampling as sa
from openrl_core.events import sessions as se
from openrl_core.events import training as te
from openrl_core.events.lifecycle import BlobRef, CheckpointSaved, RequestCompleted, RequestFailed, SamplingSessionBound
from openrl_core.params import AdamParams, LoraConfig, SamplingParams


def history(store: EventStore) -> None:
    """A small but complete life: sessions, models, steps, a refusal, saves, samples, a finish."""

    def put(type_, payload, tenant="alice", dedup=None):
        store.append(
            new_event(type_, payload, tenant=tenant, source="/t", key=getattr(payload, "model_id", None)), dedup=dedup
        )

    for tenant, sid in (("alice", "s1"), ("bob", "s2")):
        put(se.SESSION_CREATED, se.SessionCreated(session_id=sid, tags=["x"], user_metadata={"k": "v"}), tenant)
    put(te.CREATE_MODEL["requested"], te.CreateModelRequested(request_id="c1", session_id="s1", model_id="s1:train:0", model_seq_id=0,
                                                               base_model="m", lora_config=LoraConfig(rank=8)), dedup=Dedup.of("model:s1:0", b"a"))  # fmt: skip
    put(te.CREATE_MODEL["completed"], RequestCompleted(request_id="c1", result={"model_id": "s1:train:0"}))
    put(te.OPTIM_STEP["requested"], te.OptimStepRequested(request_id="o1", model_id="s1:train:0", seq_id=1, adam_params=AdamParams()),
        dedup=Dedup.of("seq:s1:train:0:1", b"o"))  # fmt: skip
    put(te.OPTIM_STEP["failed"], RequestFailed(request_id="o1", error="boom", category="user"))
    put(
        te.SEQ_SKIPPED,
        te.SeqSkipped(model_id="s1:train:0", seq_id=2, reason="bad"),
        dedup=Dedup.of("seq:s1:train:0:2", b"x").refused(),
    )
    put(te.SAVE_WEIGHTS["requested"], te.SaveWeightsRequested(request_id="w1", model_id="s1:train:0", seq_id=3, name="final"),
        dedup=Dedup.of("seq:s1:train:0:3", b"w"))  # fmt: skip
    saved = CheckpointSaved(
        run_id="s1:train:0", kind="weights", name="final", files={"a": BlobRef(sha256="b" * 64, size=3)}
    )
    put(
        te.SAVE_WEIGHTS["completed"],
        RequestCompleted(request_id="w1", result={"path": saved.tinker_path}, checkpoint=saved),
    )
    put(te.SAVE_WEIGHTS_FOR_SAMPLER["requested"], te.SaveWeightsForSamplerRequested(request_id="p1", model_id="s1:train:0", seq_id=4,
                                                                                    sampling_session_id="s1:sample:0"))  # fmt: skip
    bound = SamplingSessionBound(
        sampling_session_id="s1:sample:0",
        session_id="s1",
        base_model="m",
        adapter={"a": BlobRef(sha256="c" * 64, size=1)},
    )
    put(te.SAVE_WEIGHTS_FOR_SAMPLER["completed"], RequestCompleted(request_id="p1", result={}, sampling_session=bound))
    put(sa.SAMPLE["requested"], sa.SampleRequested(request_id="r1", sampling_session_id="s1:sample:0", seq_id=0, base_model="m",
                                                   prompt_tokens=[1, 2], num_samples=1, sampling_params=SamplingParams(), sample_sequence_ids=["r1:0"]))  # fmt: skip
    put(sa.SAMPLE["completed"], RequestCompleted(request_id="r1", result={"sequences": []}))
    put(se.SESSION_FINISHED, se.SessionFinished(session_id="s1", reason="success"))


def fresh(tmp_path, name, url=None):
    engine = database.make_engine(url or f"sqlite:///{tmp_path / name}")
    database.upgrade(engine)
    return EventStore(engine, Codec(BlobStore(tmp_path / "blobs"))), Projections(engine)


def test_replay_rebuilds_every_projection_exactly(store_url, tmp_path):
    live_store, live = fresh(tmp_path, "live.db", store_url)
    history(live_store)
    target, rebuilt = fresh(tmp_path, "rebuilt.db")
    report = replay(live_store, live, target, rebuilt)
    assert report.events == 14
    assert report.differences == []
    assert rebuilt.run("alice", "s1:train:0").state == "ready"
    assert rebuilt.checkpoint("alice", "s1:train:0", "weights/final") is not None


def test_a_row_changed_behind_the_events_back_is_reported(tmp_path):
    live_store, live = fresh(tmp_path, "live.db")
    history(live_store)
    target, rebuilt = fresh(tmp_path, "rebuilt.db")
    replay(live_store, live, target, rebuilt)
    with live_store.engine.begin() as conn:
        conn.execute(update(tables.training_runs).values(lora_rank=64))
    assert diff(live, rebuilt) == ["training_runs ('s1:train:0',): columns differ: ['lora_rank']"]


class Gateway:
    """Stores each event and publishes it with its dedup identity, to the topic the real
    roles use for it: requests to the work streams, worker answers to completions, the
    rest to control."""

    def __init__(self, store: EventStore, bus) -> None:
        self.store = store
        self.publisher = EventPublisher(bus, store.codec)

    def append(self, event, dedup=None):
        family = event.type.split(".")[2]
        if event.phase == "requested" and family in ("training", "sampling"):
            where = topics.topic(event.tenant, family, "m")
        elif event.phase in ("completed", "failed") and family in ("training", "sampling"):
            where = topics.topic(event.tenant, "completions")
        else:
            where = topics.topic(event.tenant, "control")
        appended = self.store.append(event, dedup=dedup)
        self.publisher.publish(where, event, dedup)
        return appended


@pytest.fixture
def logged(tmp_path):
    live_store, live = fresh(tmp_path, "live.db")
    log = EmbeddedLog(tmp_path / "log.db", partitions=4, fsync=False)
    history(Gateway(live_store, log))
    yield live_store, live, log
    log.close()


def test_the_log_alone_rebuilds_every_projection_dedup_identities_included(logged, tmp_path):
    live_store, live, log = logged
    events = read_log(log, live_store.codec, first_wait=5, idle=0.5)
    assert len(events) == 14
    stored = {event.id: dedup for _, event, dedup in live_store.read_with_dedup(0, 100)}
    assert {event.id: dedup for event, dedup in events} == stored
    assert sum(dedup is not None for dedup in stored.values()) == 4  # create_model and 3 seq_ids, one refused
    target, rebuilt = fresh(tmp_path, "rebuilt.db")
    assert rebuild_from_events(events, target)[0] == 14
    assert diff(live, rebuilt) == []  # submissions included: the dedup identities came with the events


def test_replaying_the_log_into_a_restored_backup_adds_only_what_the_backup_lacks(logged, tmp_path):
    live_store, live, log = logged
    backup, restored = fresh(tmp_path, "backup.db")
    first = live_store.read_with_dedup(0, 6)  # the backup was taken after the first 6 events
    backup.append_batch([(event, dedup) for _, event, dedup in first])
    assert diff(live, restored) != []
    stored, _ = rebuild_from_events(read_log(log, live_store.codec, first_wait=5, idle=0.5), backup)
    assert stored == 14 - 6
    assert diff(live, restored) == []


def test_from_an_offset_only_later_records_are_read(logged):
    live_store, _, log = logged
    everything = read_log(log, live_store.codec, first_wait=5, idle=0.5)
    later = read_log(log, live_store.codec, from_offset=1, first_wait=5, idle=0.5)
    assert {event.id for event, _ in later} < {event.id for event, _ in everything}
    assert later  # several events share a partition, so some sit at offset 1 or later
