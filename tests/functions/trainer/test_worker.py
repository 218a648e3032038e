"""The trainer worker over the real embedded log and the real tiny model: ordering by
seq_id, barriers, skips, failure isolation and redelivery."""

from __future__ import annotations

import numpy as np
import pytest

from eventing import topics
from eventing.blobs import BlobStore
from eventing.bus import EventPublisher
from eventing.codec import Codec
from eventing.embedded_log import EmbeddedLog
from functions.compute.models import ModelDirectory
from functions.trainer.worker import TrainerWorker
from openrl_core.catalog import TINY_QWEN3, Catalog
from openrl_core.datum import Datum, DatumRecord
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.params import AdamParams, LoraConfig

TENANT = "alice"
MODEL_ID = "s1:train:0"


@pytest.fixture
def rig(tmp_path, tiny_files):
    log = EmbeddedLog(tmp_path / "log.db")
    codec = Codec(BlobStore(tmp_path / "blobs"))
    publisher = EventPublisher(log, codec)
    models = ModelDirectory(Catalog.from_names([TINY_QWEN3]))
    worker = TrainerWorker(log, publisher, codec.blobs, models)
    completions = log.consumer("test-completions", pattern=topics.pattern("completions"))
    yield worker, publisher, completions, log
    log.close()


def send(publisher, type_, payload):
    event = new_event(type_, payload, tenant=TENANT, source="/test", key=payload.model_id)
    publisher.publish(topics.topic(TENANT, "training", TINY_QWEN3), event)
    return event


def datum(tokens=(1, 2, 3, 4, 5, 6)):
    tokens = np.array(tokens, dtype=np.int64)
    return DatumRecord.from_datum(
        Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(len(tokens) - 1, np.float32)})
    )


def fb(seq, request_id=None, data=None):
    return te.ForwardBackwardRequested(
        request_id=request_id or f"fb-{seq}",
        model_id=MODEL_ID,
        seq_id=seq,
        loss_fn="cross_entropy",
        data=data or [datum()],
    )


def optim(seq):
    return te.OptimStepRequested(
        request_id=f"opt-{seq}", model_id=MODEL_ID, seq_id=seq, adam_params=AdamParams(learning_rate=1e-2)
    )


def pump(worker, completions, expected):
    """Run the worker until `expected` completions are out; return them in emission order."""
    out = []
    for _ in range(50):
        worker.run_once(timeout=0.1)
        out += [worker.publisher.codec.decode(r.message) for r in completions.poll(timeout=0.1)]
        if len(out) >= expected:
            break
    return out


def create(worker, publisher, completions):
    payload = te.CreateModelRequested(
        request_id="create",
        session_id="s1",
        model_id=MODEL_ID,
        model_seq_id=0,
        base_model=TINY_QWEN3,
        lora_config=LoraConfig(rank=4, seed=1),
    )
    send(publisher, te.CREATE_MODEL["requested"], payload)
    [done] = pump(worker, completions, 1)
    assert done.type == te.CREATE_MODEL["completed"]


def test_out_of_order_requests_apply_in_seq_order_and_optim_step_is_a_barrier(rig):
    worker, publisher, completions, _ = rig
    create(worker, publisher, completions)
    # The SDK sends chunks in parallel; here seq 3 (a forward_backward after the optim_step
    # at seq 2) arrives first, then 2, then 1.
    send(publisher, te.FORWARD_BACKWARD["requested"], fb(3))
    send(publisher, te.OPTIM_STEP["requested"], optim(2))
    assert pump(worker, completions, 1) == []  # nothing can run before seq 1
    send(publisher, te.FORWARD_BACKWARD["requested"], fb(1))
    done = pump(worker, completions, 3)
    assert [e.data.request_id for e in done] == ["fb-1", "opt-2", "fb-3"]
    before, after = (e.data.result["metrics"]["loss:sum"] for e in (done[0], done[2]))
    assert after < before  # fb-3 saw the weights after the optim_step, never before it


def test_a_skipped_seq_unblocks_and_a_failure_stays_alone(rig):
    worker, publisher, completions, _ = rig
    create(worker, publisher, completions)
    send(publisher, te.FORWARD_BACKWARD["requested"], fb(2))
    send(publisher, te.SEQ_SKIPPED, te.SeqSkipped(model_id=MODEL_ID, seq_id=1, reason="refused by the gateway"))
    # seq 3 is malformed in a way only the worker can see (token id beyond the vocabulary)
    send(publisher, te.FORWARD_BACKWARD["requested"], fb(3, data=[datum((1, 2, 10**7))]))
    send(publisher, te.FORWARD_BACKWARD["requested"], fb(4))
    done = {e.data.request_id: e for e in pump(worker, completions, 3)}
    assert done["fb-2"].type == te.FORWARD_BACKWARD["completed"]
    assert done["fb-3"].type == te.FORWARD_BACKWARD["failed"]
    assert done["fb-3"].data.category == "user" and "vocabulary" in done["fb-3"].data.error
    assert done["fb-4"].type == te.FORWARD_BACKWARD["completed"]


def test_a_redelivered_step_is_not_applied_twice(rig):
    worker, publisher, completions, _ = rig
    create(worker, publisher, completions)
    send(publisher, te.FORWARD_BACKWARD["requested"], fb(1))
    step = send(publisher, te.OPTIM_STEP["requested"], optim(2))
    assert len(pump(worker, completions, 2)) == 2
    engine = worker.engine(TINY_QWEN3)
    weights = {k: v.copy() for k, v in engine.adapter_weights(MODEL_ID).items()}
    publisher.publish(topics.topic(TENANT, "training", TINY_QWEN3), step)  # the log delivers it again
    assert pump(worker, completions, 1) == []
    assert all(np.array_equal(weights[k], v) for k, v in engine.adapter_weights(MODEL_ID).items())


def test_offsets_are_not_committed_past_a_held_request(rig):
    worker, publisher, completions, log = rig
    create(worker, publisher, completions)
    held = send(publisher, te.FORWARD_BACKWARD["requested"], fb(2))
    pump(worker, completions, 1)
    committed = worker.consumer.committed()
    partition = next(p for (t, p) in committed if t == topics.topic(TENANT, "training", TINY_QWEN3))
    # the create_model record (offset 0) is done; the held seq 2 (offset 1) is not committed
    assert committed[(topics.topic(TENANT, "training", TINY_QWEN3), partition)] == 1
    assert held.id  # and it is still on the log for whoever takes over


def test_several_models_forward_backward_share_a_pass_and_answer_as_alone(tmp_path, tiny_files):
    """Three tenants' LoRA models send a forward_backward each (one also its optim_step): the
    worker runs the three in one packed pass, one turn, and every answer and every adapter is
    bitwise what a worker running them one at a time computes."""
    from functions.trainer.engine import TrainerEngine

    def world(name):
        log = EmbeddedLog(tmp_path / f"{name}.db")
        codec = Codec(BlobStore(tmp_path / f"{name}-blobs"))
        publisher = EventPublisher(log, codec)
        worker = TrainerWorker(log, publisher, codec.blobs, ModelDirectory(Catalog.from_names([TINY_QWEN3])))
        return worker, publisher, log.consumer("c", pattern=topics.pattern("completions")), log

    models = [("alice", "s1:train:0", 4, (1, 2, 3, 4, 5, 6)), ("bob", "s2:train:0", 8, (7, 8, 9, 10)),
              ("carol", "s3:train:0", 16, (11, 12, 13, 14, 15, 16, 17, 18, 19))]  # fmt: skip

    def send_all(publisher, rounds):
        for tenant, model_id, rank, _ in models:
            create = te.CreateModelRequested(request_id=f"create-{model_id}", session_id=model_id.split(":")[0], model_id=model_id,
                                             model_seq_id=0, base_model=TINY_QWEN3, lora_config=LoraConfig(rank=rank, seed=rank))  # fmt: skip
            publisher.publish(
                topics.topic(tenant, "training", TINY_QWEN3),
                new_event(te.CREATE_MODEL["requested"], create, tenant=tenant, source="/t", key=model_id),
            )
        for round_ in rounds:
            for tenant, model_id, _rank, tokens in round_:
                payload = te.ForwardBackwardRequested(request_id=f"fb-{model_id}", model_id=model_id, seq_id=1, loss_fn="cross_entropy",
                                                      data=[datum(tokens)])  # fmt: skip
                publisher.publish(
                    topics.topic(tenant, "training", TINY_QWEN3),
                    new_event(te.FORWARD_BACKWARD["requested"], payload, tenant=tenant, source="/t", key=model_id),
                )

    calls = []
    original = TrainerEngine.forward_backward_many

    def spy(self, requests):
        calls.append([r.model_id for r in requests])
        return original(self, requests)

    # packed: everything on the log before the worker looks
    worker, publisher, completions, log = world("packed")
    send_all(publisher, [models])
    TrainerEngine.forward_backward_many = spy
    try:
        packed = {e.data.request_id: e for e in pump(worker, completions, 6)}
    finally:
        TrainerEngine.forward_backward_many = original
    assert sorted(len(c) for c in calls)[-1] == 3, calls  # one pass served all three
    # alone: one model's request at a time
    alone_worker, alone_publisher, alone_completions, alone_log = world("alone")
    send_all(alone_publisher, [])
    pump(alone_worker, alone_completions, 3)
    alone = {}
    for tenant, model_id, _rank, tokens in models:
        payload = te.ForwardBackwardRequested(
            request_id=f"fb-{model_id}", model_id=model_id, seq_id=1, loss_fn="cross_entropy", data=[datum(tokens)]
        )
        alone_publisher.publish(
            topics.topic(tenant, "training", TINY_QWEN3),
            new_event(te.FORWARD_BACKWARD["requested"], payload, tenant=tenant, source="/t", key=model_id),
        )
        alone.update({e.data.request_id: e for e in pump(alone_worker, alone_completions, 1)})
    for _tenant, model_id, _rank, _tokens in models:
        key = f"fb-{model_id}"
        assert packed[key].data.result == alone[key].data.result
        want = alone_worker.engine(TINY_QWEN3).adapter_gradients(model_id)
        have = worker.engine(TINY_QWEN3).adapter_gradients(model_id)
        assert all(np.array_equal(want[k], have[k]) for k in want)
    log.close()
    alone_log.close()


def test_a_cancelled_run_loses_its_state_and_its_waiting_requests(rig):
    worker, publisher, completions, _ = rig
    create(worker, publisher, completions)
    send(publisher, te.FORWARD_BACKWARD["requested"], fb(1))
    [first] = pump(worker, completions, 1)
    # What the per-step metrics read: the tokens trained on and when the work began.
    assert first.data.details["tokens"] == 5 and first.data.details["forward_only"] is False
    assert "started" in first.data.details
    send(publisher, te.OPTIM_STEP["requested"], optim(3))  # waits for seq 2, which never comes
    assert pump(worker, completions, 1) == []
    job = worker._job(MODEL_ID)
    assert worker.engine(TINY_QWEN3).has_adapter(MODEL_ID) and worker.slicer.registered(job)

    send(publisher, te.RUN_CANCELLED, te.RunCancelled(model_id=MODEL_ID))
    send(publisher, te.FORWARD_BACKWARD["requested"], fb(2))  # a late request: ignored
    assert pump(worker, completions, 1) == []
    assert not worker.engine(TINY_QWEN3).has_adapter(MODEL_ID)
    assert MODEL_ID not in worker.slots and not worker.slicer.registered(job)
    # The held optim_step no longer pins the committed offset: everything polled can be committed.
    assert worker.offsets.committable() == worker.offsets._next


def test_a_packed_pass_runs_its_models_optim_steps_in_the_same_turn_and_answers_them_together(tmp_path, tiny_files):
    """Three models each send forward_backward then optim_step: the forward_backwards share a
    pass, and the three optim_steps run in that pass's turn (one lease) and are published in
    one append after it, so the models finish their step at one moment."""
    log = EmbeddedLog(tmp_path / "log.db")
    codec = Codec(BlobStore(tmp_path / "blobs"))
    publisher = EventPublisher(log, codec)
    worker = TrainerWorker(log, publisher, codec.blobs, ModelDirectory(Catalog.from_names([TINY_QWEN3])))
    completions = log.consumer("c", pattern=topics.pattern("completions"))
    models = [(f"t{i}", f"s{i}:train:0") for i in range(3)]
    for tenant, model_id in models:
        payload = te.CreateModelRequested(request_id=f"create-{model_id}", session_id=model_id.split(":")[0], model_id=model_id,
                                          model_seq_id=0, base_model=TINY_QWEN3, lora_config=LoraConfig(rank=4, seed=1))  # fmt: skip
        publisher.publish(
            topics.topic(tenant, "training", TINY_QWEN3),
            new_event(te.CREATE_MODEL["requested"], payload, tenant=tenant, source="/t", key=model_id),
        )
    assert len(pump(worker, completions, 3)) == 3
    for tenant, model_id in models:
        step = te.ForwardBackwardRequested(
            request_id=f"fb-{model_id}", model_id=model_id, seq_id=1, loss_fn="cross_entropy", data=[datum()]
        )
        update = te.OptimStepRequested(
            request_id=f"opt-{model_id}", model_id=model_id, seq_id=2, adam_params=AdamParams(learning_rate=1e-2)
        )
        for type_, item in ((te.FORWARD_BACKWARD["requested"], step), (te.OPTIM_STEP["requested"], update)):
            publisher.publish(
                topics.topic(tenant, "training", TINY_QWEN3),
                new_event(type_, item, tenant=tenant, source="/t", key=model_id),
            )
    appends: list[list[str]] = []
    publish_many = publisher.publish_many

    def spy(events):
        appends.append([event.data.request_id for _topic, event, _dedup in events])
        return publish_many(events)

    publisher.publish_many = spy
    done = {e.data.request_id: e for e in pump(worker, completions, 6)}
    assert all(
        done[f"{kind}-{model_id}"].type.endswith(".completed.v1") for kind in ("fb", "opt") for _t, model_id in models
    )
    leases = {done[f"{kind}-{model_id}"].lease for kind in ("fb", "opt") for _t, model_id in models}
    assert len(leases) == 1 and None not in leases  # one turn for the pass and every optim_step
    assert sorted(appends[-1]) == sorted(f"opt-{model_id}" for _t, model_id in models)  # answered together
    log.close()


def test_a_run_created_during_a_packed_pass_waits_for_the_turn_to_end_not_for_itself(tmp_path, tiny_files):
    """A packed pass takes in what reached the log during it (its models' optim_steps) in its
    own turn. A run created (or forked, or restored) meanwhile needs a turn of its own: taking
    it from inside the pass's turn waited for the device this very thread held, and the trainer
    hung for good (an autoresearch sweep starting its fifth run while four trained). It runs
    right after the turn instead, and every request is answered."""
    import threading

    from functions.trainer.engine import TrainerEngine

    log = EmbeddedLog(tmp_path / "log.db")
    codec = Codec(BlobStore(tmp_path / "blobs"))
    publisher = EventPublisher(log, codec)
    worker = TrainerWorker(log, publisher, codec.blobs, ModelDirectory(Catalog.from_names([TINY_QWEN3])))
    completions = log.consumer("c", pattern=topics.pattern("completions"))

    def create(tenant, model_id):
        payload = te.CreateModelRequested(request_id=f"create-{model_id}", session_id=model_id.split(":")[0], model_id=model_id,
                                          model_seq_id=0, base_model=TINY_QWEN3, lora_config=LoraConfig(rank=4, seed=1))  # fmt: skip
        publisher.publish(
            topics.topic(tenant, "training", TINY_QWEN3),
            new_event(te.CREATE_MODEL["requested"], payload, tenant=tenant, source="/t", key=model_id),
        )

    def train(tenant, model_id):
        step = te.ForwardBackwardRequested(
            request_id=f"fb-{model_id}", model_id=model_id, seq_id=1, loss_fn="cross_entropy", data=[datum()]
        )
        update = te.OptimStepRequested(
            request_id=f"opt-{model_id}", model_id=model_id, seq_id=2, adam_params=AdamParams(learning_rate=1e-2)
        )
        for type_, item in ((te.FORWARD_BACKWARD["requested"], step), (te.OPTIM_STEP["requested"], update)):
            publisher.publish(
                topics.topic(tenant, "training", TINY_QWEN3),
                new_event(type_, item, tenant=tenant, source="/t", key=model_id),
            )

    packed = [("t0", "s0:train:0"), ("t1", "s1:train:0")]
    for tenant, model_id in packed:
        create(tenant, model_id)
    assert len(pump(worker, completions, 2)) == 2
    original = TrainerEngine.forward_backward_many
    passes = []

    def during_the_pass(self, requests):
        passes.append([r.model_id for r in requests])
        if len(passes) == 1:  # the third run's creation and first step reach the log meanwhile
            create("t2", "s2:train:0")
        return original(self, requests)

    for tenant, model_id in packed:
        train(tenant, model_id)
    TrainerEngine.forward_backward_many = during_the_pass
    done: dict = {}
    try:
        pumping = threading.Thread(
            target=lambda: done.update({e.data.request_id: e for e in pump(worker, completions, 5)}), daemon=True
        )
        pumping.start()
        pumping.join(120)
        assert not pumping.is_alive(), "the trainer waited for a turn inside its own turn"
    finally:
        TrainerEngine.forward_backward_many = original
    assert sorted(passes[0]) == [model_id for _t, model_id in packed]  # it was a packed pass
    assert sorted(done) == sorted(["create-s2:train:0"] + [f"{kind}-{m}" for kind in ("fb", "opt") for _t, m in packed])
    assert all(event.type.endswith(".completed.v1") for event in done.values())
    # The new run trains like any other, and nothing it held pins the committed offsets.
    train("t2", "s2:train:0")
    assert {e.data.request_id for e in pump(worker, completions, 2)} == {"fb-s2:train:0", "opt-s2:train:0"}
    assert worker.offsets.committable() == worker.offsets._next
    log.close()
