"""Jobs that park: `openrl serve` with an accelerator budget smaller than its jobs' state.

Two full fine-tuning runs and a LoRA run (two tenants) train in turns, step by step, on one
server whose timeslicer budget holds only some of them at a time, so every switch between
the full runs parks one (weights, gradients and AdamW moments to host memory) and restores
the other. Each run's losses and final state must be bitwise those of the same run trained
alone, and the timeslicer must have really parked and restored.
"""

from __future__ import annotations

import json

import pytest
import tinker
from tinker import types

from functions.local_server import LocalServer
from functions.timeslicer.cli import _ask
from tests.e2e.sdk_close import close_service
from tests.e2e.test_sdk_full_finetune import datums
from tests.functions.trainer.conftest import sft_batch

pytestmark = pytest.mark.e2e
MODEL = "openrl/tiny-qwen3"
KEYS = "alice=tml-share-alice,bob=tml-share-bob"
RUNS = [("tml-share-alice", True, 1), ("tml-share-alice", True, 2), ("tml-share-bob", False, 3)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # tiny Qwen3: a full run's state is 20M parameters x 16 bytes = 319 MB; the budget holds
    # the two base copies (trainer LoRA base, sampler base) and one full run, not two.
    env = {"OPENRL_ACCELERATOR_MEMORY": "560MiB", "OPENRL_TIMESLICER_POLICY": "lrs", "OPENRL_SNAPSHOT_EVERY_STEPS": "0"}
    srv = LocalServer(tmp_path_factory.mktemp("shared"), [MODEL], KEYS, extra_env=env)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def start(server, key, full, seed):
    service = tinker.ServiceClient(base_url=server.url, api_key=key)
    metadata = {"openrl.full_finetune": "true"} if full else None
    return service, service.create_lora_training_client(
        base_model=MODEL, rank=4, seed=seed, user_metadata=metadata
    ).result()


def step(training, seed, i):
    out = training.forward_backward(datums(sft_batch(seed * 10 + i, [6, 11])), "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return out.result().metrics["loss:sum"]


def state_files(server, path):
    from sqlalchemy import create_engine, select

    from eventing.store import tables

    engine = create_engine(f"sqlite:///{server.data_dir / 'events.db'}")
    with engine.connect() as conn:
        files = conn.execute(
            select(tables.checkpoints.c.files).where(tables.checkpoints.c.tinker_path == path)
        ).scalar()
    engine.dispose()
    return {name: ref["sha256"] for name, ref in files.items()}


def device(server):
    return _ask(server.data_dir.resolve() / "timeslicer.sock", {"op": "status", "id": 1})["status"]["devices"][0]


def test_runs_that_park_in_turn_train_bitwise_as_alone(server):
    steps = 3
    alone = []
    for key, full, seed in RUNS:
        service, training = start(server, key, full, seed)
        losses = [step(training, seed, i) for i in range(steps)]
        alone.append((losses, state_files(server, training.save_state(f"alone-{seed}").result().path)))
        close_service(service)
    before = device(server)

    clients = [start(server, key, full, seed) for key, full, seed in RUNS]
    together = [[] for _ in RUNS]
    for i in range(steps):
        for index, ((_, training), (_, _, seed)) in enumerate(zip(clients, RUNS)):
            together[index].append(step(training, seed, i))
    for index, ((service, training), (_, _, seed)) in enumerate(zip(clients, RUNS)):
        files = state_files(server, training.save_state(f"together-{seed}").result().path)
        assert together[index] == alone[index][0], f"run {index}: losses differ"
        assert files == alone[index][1], f"run {index}: weights or optimizer differ"
        close_service(service)

    after = device(server)
    assert after["budget_bytes"] == 560 * 2**20
    assert after["parks"] - before["parks"] >= 2 * steps - 1, json.dumps(after)
    assert after["restores"] - before["restores"] >= 2 * steps - 1
    assert after["park_bytes"] - before["park_bytes"] >= 300 * 2**20 * (2 * steps - 1)
    assert after["resident_bytes"] <= after["budget_bytes"]
