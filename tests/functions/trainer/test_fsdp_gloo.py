"""FSDP2 full fine-tuning (functions/trainer/fsdp.py) on two CPU processes over gloo, against one process.

Two ranks (subprocesses running tests/functions/trainer/fsdp_rank.py) train the tiny Qwen3
for three AdamW steps (weight decay, gradient clipping) with the batch split between them;
the single-process reference is `FullFinetuneEngine`, itself tested bitwise against plain
torch (test_full.py). Tolerances: float32 reduction order only, so losses and gradient norms
within 1e-5 relative, logprobs within 1e-5; weights: every element within 2 x lr x steps
(where a gradient is near zero Adam's normalised step can flip sign on a rounding
difference) and at most 1e-5 of them more than 1e-6 apart (measured: 1 of 20 M).

Recovery: rank 1 is killed with SIGKILL right after the step-2 distributed checkpoint; the
other rank, left in a collective, is killed too; two fresh ranks load the checkpoint and
replay step 3, ending bitwise where the uninterrupted run did.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from functions.compute.weight_sync import Receiver, read_manifest
from functions.trainer.full import FullFinetuneEngine
from openrl_core import memory
from openrl_core.events.lifecycle import BlobRef
from tests.functions.trainer.conftest import sft_batch
from tests.functions.trainer.fsdp_rank import CHECKPOINT_AT, HP, LENGTHS, STEPS

ROOT = Path(__file__).resolve().parents[3]
WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, mode: str) -> list[subprocess.Popen]:
    port = free_port()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tests.functions.trainer.fsdp_rank", str(rank), str(WORLD), str(port), str(out), mode],
            cwd=ROOT, env=env, stdout=open(out / f"{mode}-{rank}.log", "w"), stderr=subprocess.STDOUT,
        )
        for rank in range(WORLD)
    ]  # fmt: skip


def finish(ranks: list[subprocess.Popen], out: Path, mode: str) -> None:
    for rank, process in enumerate(ranks):
        code = process.wait(timeout=240)
        assert code == 0, (out / f"{mode}-{rank}.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    finish(launch(out, "train"), out, "train")
    return out, torch.load(out / "train.pt")


def test_two_ranks_train_as_one_process(trained, tiny_files):
    _, sharded = trained
    engine = FullFinetuneEngine(tiny_files)
    engine.create("r")
    losses, norms, logprobs = [], [], []
    for step in range(STEPS):
        result = engine.forward_backward("r", sft_batch(step, LENGTHS), "cross_entropy", None, False)
        losses.append(result.metrics["loss:sum"])
        logprobs.append(result.logprobs)
        norms.append(engine.optim_step("r", HP)["optim/grad_norm"])
    np.testing.assert_allclose(sharded["losses"], losses, rtol=1e-5)
    np.testing.assert_allclose(sharded["norms"], norms, rtol=1e-5)
    for have_step, want_step in zip(sharded["logprobs"], logprobs):
        for have, want in zip(have_step, want_step):
            np.testing.assert_allclose(have.numpy(), want, atol=1e-5)
    weights = engine.weights("r")
    assert set(sharded["weights"]) == set(weights)
    moved = torch.cat([(sharded["weights"][k] - weights[k]).abs().ravel() for k in weights])
    assert float(moved.max()) <= 2 * HP.learning_rate * STEPS
    assert float((moved > 1e-6).double().mean()) <= 1e-5
    # Each rank holds half of the run's float32 weights, gradients and moments (the memory model).
    parameters = sum(w.numel() for w in weights.values())
    assert sharded["local_bytes"] == memory.full_state_bytes(parameters, WORLD)


def test_sampler_weights_are_published_from_the_gathered_weights_in_bf16(trained):
    """Rank 0 publishes each step (weight_sync.Publisher); a receiver that follows
    the manifests holds bitwise the bf16 of the gathered float32 weights."""
    out, sharded = trained
    blobs = out / "blobs-train"

    def fetch(ref):
        return (blobs / ref.sha256).read_bytes()

    # The first is a full checkpoint; later ones are deltas unless too dense (at lr 1e-4 on the
    # tiny model's random weights most bf16 elements change each step, so they are full too).
    kinds = [kind for kind, _, _ in sharded["publications"]]
    assert len(kinds) == STEPS and kinds[0] == "full" and set(kinds) <= {"full", "delta"}
    weights = sharded["weights"]
    receiver = Receiver(
        {k: torch.nn.Parameter(torch.zeros(v.shape), requires_grad=False) for k, v in weights.items()}, "bfloat16"
    )
    for _, manifest, _ in sharded["publications"]:
        receiver.update(read_manifest(fetch(BlobRef(sha256=manifest, size=0))), fetch)
    for key, tensor in weights.items():
        have = receiver.params[key].detach().to(torch.bfloat16).view(torch.int16)
        assert torch.equal(have, tensor.to(torch.bfloat16).view(torch.int16)), key
    assert receiver.version == STEPS


def test_a_rank_killed_after_a_checkpoint_is_recovered_by_reloading_and_replaying(trained):
    out, uninterrupted = trained
    # The dying run writes its own checkpoint (same steps, so the same bits) over the fixture's.
    ranks = launch(out, "die")
    assert ranks[1].wait(timeout=240) == -signal.SIGKILL, (out / "die-1.log").read_text()[-3000:]
    try:
        ranks[0].wait(timeout=5)  # blocked in step 3's collectives, or failed by gloo
    except subprocess.TimeoutExpired:
        ranks[0].kill()
        ranks[0].wait()
    assert (out / "checkpoint" / ".metadata").exists()
    finish(launch(out, "resume"), out, "resume")
    resumed = torch.load(out / "resume.pt")
    assert resumed["losses"] == uninterrupted["losses"][CHECKPOINT_AT:]
    assert resumed["norms"] == uninterrupted["norms"][CHECKPOINT_AT:]
    for key, tensor in uninterrupted["weights"].items():
        assert torch.equal(resumed["weights"][key], tensor), key
