"""Packing across processes in the distributed deployment: the `openrl trainer` process (over
noida-db and PostgreSQL, taking its turns from the node's timeslicer daemon) runs the
`forward_backward` requests of three LoRA runs of two tenants, sent through the real SDK at
the same moment (a barrier per step), as shared passes, and every run's losses, logprobs and
final weights and Adam state are bitwise those of the same run done alone on the same
deployment.

What shows the passes were shared is the trainer's own debug line ("trainer: packed N
requests of M models on BASE (model ids)"), nothing mocked: none while the runs go alone,
and one naming models of both tenants while they go together.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.cluster import KEY, MODEL, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.kafka, pytest.mark.postgres]
BOB = "tml-cluster-bob"
STEPS = 3
ADAM = types.AdamParams(learning_rate=5e-3)
PACKED = re.compile(r"trainer: packed (\d+) requests of (\d+) models on \S+ \((.*)\)")
# name: (API key, LoRA rank, seed, text repeats, loss); different lengths and losses share passes
RUNS = {
    "alice-1": (KEY, 4, 1, 1, "cross_entropy"),
    "alice-2": (KEY, 8, 2, 3, "importance_sampling"),
    "bob-1": (BOB, 4, 3, 2, "cross_entropy"),
}
TEXT = "The quick brown fox jumps over the lazy dog. "


@pytest.fixture
def cluster(tmp_path, pg_url):
    debug = {"trainer": {"OPENRL_LOG_LEVEL": "DEBUG"}}
    with Cluster(tmp_path, pg_url, timeslicer=True, keys=f"alice={KEY},bob={BOB}", role_env=debug).running() as cluster:
        yield cluster


def batch(tokenizer, repeats: int, loss: str) -> list[types.Datum]:
    tokens = tokenizer.encode(TEXT * repeats)
    data = []
    for piece in (tokens, tokens[: len(tokens) // 2 + 2]):
        n = len(piece) - 1
        if loss == "cross_entropy":
            inputs = {"target_tokens": piece[1:], "weights": [0.0] + [1.0] * (n - 1)}
        else:
            advantages = [(-1.0) ** i * (1 + i % 3) / 3 for i in range(n)]
            inputs = {
                "target_tokens": piece[1:],
                "logprobs": [-8.0 - (i % 5) / 10 for i in range(n)],
                "advantages": advantages,
            }
        data.append(types.Datum(model_input=types.ModelInput.from_ints(piece[:-1]), loss_fn_inputs=inputs))
    return data


def train(url: str, name: str, barrier=None) -> dict:
    """One run of STEPS steps; with `barrier`, each step's forward_backward is sent the moment
    every run is ready to send its own."""
    key, rank, seed, repeats, loss = RUNS[name]
    training = (
        tinker.ServiceClient(base_url=url, api_key=key)
        .create_lora_training_client(base_model=MODEL, rank=rank, seed=seed)
        .result()
    )
    data = batch(training.get_tokenizer(), repeats, loss)
    metrics, logprobs = [], []
    for _ in range(STEPS):
        if barrier is not None:
            barrier.wait(timeout=120)
        fb = training.forward_backward(data, loss)
        opt = training.optim_step(ADAM)
        out = fb.result()
        opt.result()
        metrics.append(out.metrics)
        logprobs.append([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])
    path = training.save_state("final").result().path
    return {"model_id": training.model_id, "metrics": metrics, "logprobs": logprobs, "path": path}


def packed_passes(log: str) -> list[tuple[int, set]]:
    return [(int(m[1]), set(m[3].split(", "))) for m in PACKED.finditer(log)]


def test_runs_of_two_tenants_share_trainer_passes_and_each_is_bitwise_its_run_alone(cluster):
    trainer_log = cluster.workers["trainer"].log_path
    alone = {name: train(cluster.url, name) for name in RUNS}  # one after another: nothing to pack
    before = len(trainer_log.read_text())
    barrier = threading.Barrier(len(RUNS))
    with ThreadPoolExecutor(len(RUNS)) as pool:
        futures = {name: pool.submit(train, cluster.url, name, barrier) for name in RUNS}
        together = {name: future.result() for name, future in futures.items()}
    log = trainer_log.read_text()
    assert packed_passes(log[:before]) == []
    passes = packed_passes(log[before:])
    alices = {together["alice-1"]["model_id"], together["alice-2"]["model_id"]}
    shared = [models for count, models in passes if together["bob-1"]["model_id"] in models and models & alices]
    assert shared, f"no pass shared by both tenants' runs: {passes}"
    assert all(models <= alices | {together["bob-1"]["model_id"]} for _, models in passes)
    for name in RUNS:
        want, got = alone[name], together[name]
        assert got["metrics"] == want["metrics"], name
        for step_want, step_got in zip(want["logprobs"], got["logprobs"], strict=True):
            for w, g in zip(step_want, step_got, strict=True):
                assert np.array_equal(w, g), name
        # LoRA weights and Adam moments after the last optim_step, bitwise (the stored files' SHA-256)
        assert cluster.checkpoint_files(got["path"]) == cluster.checkpoint_files(want["path"]), name
