"""The trainer worker serves tenants in turn: with four models of one tenant and one of
another ready in the same poll, the second tenant's request runs second, not last (it ran
last before, behind every model of the first tenant, whose topic the log reads first)."""

from __future__ import annotations

import pytest

from eventing import topics
from eventing.blobs import BlobStore
from eventing.bus import EventPublisher
from eventing.codec import Codec
from eventing.embedded_log import EmbeddedLog
from functions.compute.models import ModelDirectory
from functions.trainer.worker import TrainerWorker
from openrl_core.catalog import TINY_QWEN3, Catalog
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.params import AdamParams, LoraConfig

HEAVY, LIGHT = "aaa-heavy", "zzz-light"  # the heavy tenant's topic sorts, and is read, first


@pytest.fixture
def rig(tmp_path, tiny_files):
    log = EmbeddedLog(tmp_path / "log.db")
    codec = Codec(BlobStore(tmp_path / "blobs"))
    publisher = EventPublisher(log, codec)
    worker = TrainerWorker(log, publisher, codec.blobs, ModelDirectory(Catalog.from_names([TINY_QWEN3])))
    completions = log.consumer("test-completions", pattern=topics.pattern("completions"))
    yield worker, publisher, completions
    log.close()


def send(publisher, tenant: str, type_: str, payload) -> None:
    event = new_event(type_, payload, tenant=tenant, source="/test", key=payload.model_id)
    publisher.publish(topics.topic(tenant, "training", TINY_QWEN3), event)


def collect(worker, completions, expected: int) -> list:
    """Completions in the order the worker emitted them (each tenant has its own completions
    topic, which a consumer reads one after another, so the append time orders them)."""
    records = []
    for _ in range(50):
        worker.run_once(timeout=0.1)
        records += completions.poll(timeout=0.1)
        if len(records) >= expected:
            return [worker.publisher.codec.decode(r.message) for r in sorted(records, key=lambda r: r.timestamp)]
    raise AssertionError(f"only {len(records)} of {expected} completions")


def test_a_light_tenant_is_served_after_one_turn_of_a_heavy_one_not_after_all(rig):
    worker, publisher, completions = rig
    models = [(HEAVY, f"s{i}:train:0") for i in range(4)] + [(LIGHT, "s9:train:0")]
    for tenant, model_id in models:
        session = model_id.split(":")[0]
        create = te.CreateModelRequested(
            request_id=f"create-{model_id}", session_id=session, model_id=model_id, model_seq_id=0, base_model=TINY_QWEN3,
            lora_config=LoraConfig(rank=4, seed=1),
        )  # fmt: skip
        send(publisher, tenant, te.CREATE_MODEL["requested"], create)
    collect(worker, completions, len(models))
    for tenant, model_id in models:  # one poll makes them all ready: each model's step, two requests
        for seq in (1, 2):
            step = te.OptimStepRequested(
                request_id=f"{model_id}/{seq}", model_id=model_id, seq_id=seq, adam_params=AdamParams()
            )
            send(publisher, tenant, te.OPTIM_STEP["requested"], step)
    done = collect(worker, completions, 2 * len(models))
    order = [(event.tenant, event.data.request_id) for event in done]
    # The first turn is one heavy model's (which one depends on its partition), the second the light one's.
    assert [tenant for tenant, _ in order] == [HEAVY, HEAVY, LIGHT, LIGHT] + [HEAVY] * 6, order
    assert order[0][1].split("/")[0] == order[1][1].split("/")[0]
    # Each model's own requests kept their seq order, and every request was answered.
    for _tenant, model_id in models:
        assert [rid for _, rid in order if rid.startswith(model_id)] == [f"{model_id}/1", f"{model_id}/2"]
