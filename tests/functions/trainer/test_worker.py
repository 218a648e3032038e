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
from openrl_core.catalog import Catalog, TINY_QWEN3
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
    return DatumRecord.from_datum(Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(len(tokens) - 1, np.float32)}))


def fb(seq, request_id=None, data=None):
    return te.ForwardBackwardRequested(
        request_id=request_id or f"fb-{seq}", model_id=MODEL_ID, seq_id=seq, loss_fn="cross_entropy", data=data or [datum()]
    )


def optim(seq):
    return te.OptimStepRequested(request_id=f"opt-{seq}", model_id=MODEL_ID, seq_id=seq, adam_params=AdamParams(learning_rate=1e-2))


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
        request_id="create", session_id="s1", model_id=MODEL_ID, model_seq_id=0, base_model=TINY_QWEN3, lora_config=LoraConfig(rank=4, seed=1)
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
