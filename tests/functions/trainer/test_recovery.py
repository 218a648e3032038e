"""Recovery by replay: a trainer that dies mid-run is replaced by one that restores the
latest snapshot and replays the events after it. On CPU the weights are bitwise those of an
uninterrupted run, and no optimizer step is lost or applied twice."""

from __future__ import annotations

import numpy as np
import pytest

from eventing import topics
from eventing.blobs import BlobStore
from eventing.bus import EventPublisher
from eventing.codec import Codec
from eventing.embedded_log import EmbeddedLog
from functions.compute.models import ModelDirectory
from functions.trainer import optimizer
from functions.trainer.snapshots import SnapshotStore
from functions.trainer.worker import TrainerOptions, TrainerWorker
from openrl_core.catalog import TINY_QWEN3, Catalog
from openrl_core.datum import Datum, DatumRecord
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.events.recovery import SNAPSHOT_TAKEN
from openrl_core.params import AdamParams, DimuonParams, LoraConfig, check_optimizer_config

TENANT, MODEL_ID = "alice", "s1:train:0"


def history(family: str = "adamw") -> list:
    """create (with the optimizer `family`), then fb/optim pairs: seq 1..10."""
    rng = np.random.default_rng(0)
    events = [
        new_event(
            te.CREATE_MODEL["requested"],
            te.CreateModelRequested(request_id="create", session_id="s1", model_id=MODEL_ID, model_seq_id=0,
                                    base_model=TINY_QWEN3, lora_config=LoraConfig(rank=4),
                                    optimizer_config=check_optimizer_config({"type": family})),  # fmt: skip
            tenant=TENANT, source="/t", key=MODEL_ID,
        )
    ]  # fmt: skip
    for seq in range(1, 11, 2):
        tokens = rng.integers(0, 5000, size=12)
        datum = Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(11, np.float32)})
        fb = te.ForwardBackwardRequested(request_id=f"fb{seq}", model_id=MODEL_ID, seq_id=seq, loss_fn="cross_entropy",
                                         data=[DatumRecord.from_datum(datum)])  # fmt: skip
        step = te.OptimStepRequested(
            request_id=f"op{seq + 1}",
            model_id=MODEL_ID,
            seq_id=seq + 1,
            adam_params=AdamParams(learning_rate=1e-2),
            dimuon_params=DimuonParams(learning_rate=1e-2, beta1=0.8) if family == "dimuon" else None,
        )
        events.append(new_event(te.FORWARD_BACKWARD["requested"], fb, tenant=TENANT, source="/t", key=MODEL_ID))
        events.append(new_event(te.OPTIM_STEP["requested"], step, tenant=TENANT, source="/t", key=MODEL_ID))
    return events


class Node:
    """One trainer process: a log handle, a worker, a completions reader."""

    def __init__(self, root, every, options=TrainerOptions()):
        self.log = EmbeddedLog(root / "log.db")
        codec = Codec(BlobStore(root / "blobs"))
        self.publisher = EventPublisher(self.log, codec)
        self.worker = TrainerWorker(
            self.log, self.publisher, codec.blobs, ModelDirectory(Catalog.from_names([TINY_QWEN3])),
            snapshots=SnapshotStore(root / "snapshots", codec.blobs), snapshot_every_steps=every, options=options,
        )  # fmt: skip
        self.reader = self.log.consumer(f"reader-{id(self)}", pattern=topics.pattern("completions"))
        self.codec = codec
        while self.reader.poll(timeout=0.05):
            pass  # completions of an earlier life of this log are not this node's

    def run_until(self, request_ids, rounds=60) -> dict:
        seen = {}
        for _ in range(rounds):
            self.worker.run_once(timeout=0.05)
            for record in self.reader.poll(timeout=0.05):
                event = self.codec.decode(record.message)
                seen[getattr(event.data, "request_id", event.type)] = event
            if set(request_ids) <= set(seen):
                break
        return seen

    def weights(self):
        engine = self.worker.engine(TINY_QWEN3)
        return engine.adapter_weights(MODEL_ID), engine._adapters[MODEL_ID].adam.step


def publish(node, events):
    for event in events:
        node.publisher.publish(topics.topic(TENANT, "training", TINY_QWEN3), event)


def uninterrupted(root, events) -> tuple:
    """(adapter weights, Adam step count) after a trainer ran every event without a break."""
    ids = ["create"] + [e.data.request_id for e in events[1:]]
    reference = Node(root, every=0)
    publish(reference, events)
    assert reference.run_until(ids).keys() >= set(ids)
    return reference.weights()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["adamw", "dimuon"])
def test_a_replacement_trainer_restores_the_snapshot_and_replays_to_bitwise_the_same_weights(
    tmp_path, tiny_files, family
):
    events = history(family)
    all_ids = ["create"] + [e.data.request_id for e in events[1:]]

    expected, expected_steps = uninterrupted(tmp_path / "reference", events)
    assert expected_steps == 5

    # The first trainer gets through op6 (a snapshot after op4 is durable) plus fb7, then dies.
    first = Node(tmp_path / "crashed", every=2)
    publish(first, events[:8])
    seen = first.run_until(all_ids[:8])
    first.worker.recovery.snapshotter.drain()
    first.worker.run_once(timeout=0.05)  # settle the snapshot, commit what it covers
    assert set(all_ids[:8]) <= set(seen)
    snapshot = first.worker.recovery.latest(TENANT, MODEL_ID)
    assert snapshot is not None and snapshot.next_seq == 5  # the snapshot after op4 (taken every 2 steps)
    committed = first.worker.consumer.committed()
    first.log.close()  # kill: nothing else is flushed, closed or committed

    second = Node(tmp_path / "crashed", every=2)
    publish(second, events[8:])  # the client keeps sending
    done = second.run_until(all_ids[5:])
    assert set(all_ids[5:]) <= set(done), sorted(done)  # every future after the snapshot completes
    slot = second.worker.slots[MODEL_ID]
    assert slot.gate.next_seq == 11
    weights, steps = second.weights()
    assert optimizer.family_of(second.worker.engine(TINY_QWEN3)._adapters[MODEL_ID].adam) == family
    assert steps == expected_steps  # no optimizer step lost or applied twice
    for name, value in expected.items():
        assert np.array_equal(weights[name], value), name  # bitwise
    # events the snapshot covered were not re-run: the replacement emitted nothing for them
    assert not {"fb1", "op2", "fb3", "op4"} & set(done)
    assert committed  # the first trainer had committed offsets up to its snapshot's anchor


def test_snapshots_are_announced_and_offsets_wait_for_them(tmp_path, tiny_files):
    node = Node(tmp_path, every=1)
    events = history()[:3]  # create, fb1, op2
    publish(node, events)
    node.run_until(["create", "fb1", "op2"])
    node.worker.recovery.snapshotter.drain()
    seen = node.run_until([SNAPSHOT_TAKEN], rounds=20)
    assert seen[SNAPSHOT_TAKEN].data.next_seq == 3
    tp = (topics.topic(TENANT, "training", TINY_QWEN3), next(iter(node.worker.consumer.committed()))[1])
    assert node.worker.consumer.committed()[tp] == 3  # everything up to op2 is in the snapshot
