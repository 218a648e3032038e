"""The served FSDP2 engine (functions/trainer/sharded.py): two gloo rank processes on CPU
holding the tiny Qwen3's full runs, against the single-device `FullFinetuneEngine`.

Tolerances as in test_fsdp_gloo.py (float32 reduction order only): losses and gradient norms
within 1e-5 relative, weights within Adam's sign-flip bound. Everything the engine does
between its own runs (a checkpoint loaded back, parking) is bitwise; so is every conversion
of checkpoint files (sharded <-> whole), against the single-device engine's own files.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from functions.compute.weight_sync import Receiver, read_manifest
from functions.trainer import full_files
from functions.trainer.full import FullFinetuneEngine
from functions.trainer.sharded import RankLost, ShardedFullEngine
from openrl_core import memory
from openrl_core.errors import InvalidRequest, NotFound
from openrl_core.events.lifecycle import BlobRef
from openrl_core.params import AdamParams
from tests.functions.trainer.conftest import sft_batch

pytestmark = pytest.mark.slow
HP = AdamParams(learning_rate=1e-4, grad_clip_norm=50.0, weight_decay=0.01)
LENGTHS = [5, 17, 33]  # three datums over two ranks: rank 0 gets two, rank 1 one
WORLD = 2
lost: list[RankLost] = []


@pytest.fixture(scope="module")
def sharded(tiny_files):
    engine = ShardedFullEngine(tiny_files, WORLD, on_rank_lost=lost.append)
    yield engine
    engine.close()


def train(engine, model_id: str, steps: range) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for step in steps:
        result = engine.forward_backward(model_id, sft_batch(step, LENGTHS), "cross_entropy", None, False)
        losses.append(result.metrics["loss:sum"])
        norms.append(engine.optim_step(model_id, HP)["optim/grad_norm"])
    return losses, norms


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_ranks_serve_a_run_as_one_device_does(sharded, tiny_files):
    single = FullFinetuneEngine(tiny_files)
    single.create("r")
    sharded.create("r")
    want_losses, want_norms = train(single, "r", range(3))
    have_losses, have_norms = train(sharded, "r", range(3))
    np.testing.assert_allclose(have_losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(have_norms, want_norms, rtol=1e-5)
    have, want = sharded.weights("r"), single.weights("r")
    assert have.keys() == want.keys()
    moved = torch.cat([(have[k] - want[k]).abs().ravel() for k in want])
    assert float(moved.max()) <= 2 * HP.learning_rate * 3
    assert float((moved > 1e-6).double().mean()) <= 1e-5
    # Each rank holds half of the float32 weights, gradients and moments (the memory model).
    parameters = sum(w.numel() for w in want.values())
    assert sharded.local_bytes("r") == [memory.full_state_bytes(parameters, WORLD)] * WORLD
    assert sharded.state_bytes("r") == memory.full_state_bytes(parameters, WORLD)


def test_a_sharded_checkpoint_loads_back_bitwise_and_reads_as_a_whole_one(sharded, tiny_files):
    sharded.create("ck")
    train(sharded, "ck", range(2))
    files = sharded.export_state("ck")
    assert {"shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors", "openrl_full.json",
            "optimizer.json"} == set(files)  # fmt: skip
    assert json.loads(files["openrl_full.json"])["shards"] == WORLD
    # Loaded into another sharded run: the next step is bitwise the same on both.
    sharded.import_state("ck-copy", files, with_optimizer=True)
    assert same_weights(sharded.weights("ck-copy"), sharded.weights("ck"))
    assert train(sharded, "ck-copy", range(2, 3)) == train(sharded, "ck", range(2, 3))
    assert same_weights(sharded.weights("ck-copy"), sharded.weights("ck"))
    # On one device: the same weights and moments, and the single engine's own checkpoint of
    # them is byte for byte the merged one.
    files = sharded.export_state("ck")
    single = FullFinetuneEngine(tiny_files)
    single.import_state("one", files, with_optimizer=True)
    assert same_weights(single.weights("one"), sharded.weights("ck"))
    assert single.adam_state("one").step == 3
    assert single.export_state("one") == full_files.whole(files)
    # And back: a whole checkpoint loads into the sharded engine, which saves the same shards.
    sharded.import_state("from-whole", single.export_state("one"), with_optimizer=True)
    assert sharded.export_state("from-whole") == files


def test_a_bad_checkpoint_is_refused_before_any_rank_changes(sharded):
    sharded.create("keep")
    train(sharded, "keep", range(1))
    before = sharded.weights("keep")
    files = sharded.export_state("keep")
    without_shard = {k: v for k, v in files.items() if k != "shard-00001-of-00002.safetensors"}
    with pytest.raises(InvalidRequest, match="lacks shard-00001-of-00002"):
        sharded.import_state("keep", without_shard, with_optimizer=True)
    lora = {"adapter_model.safetensors": b"", "adapter_config.json": b"{}"}
    with pytest.raises(InvalidRequest, match="LoRA checkpoint"):
        sharded.import_state("keep", lora, with_optimizer=False)
    whole = full_files.whole(files)
    tensors = full_files.tensor_files.read(whole, "model.safetensors")
    name = next(iter(tensors))
    tensors[name] = tensors[name][:1].clone()
    bad = {**whole, "model.safetensors": full_files.tensor_files.save(tensors)}
    with pytest.raises(InvalidRequest, match="has shape"):
        sharded.import_state("keep", bad, with_optimizer=True)
    with pytest.raises(InvalidRequest, match="has shape"):
        sharded.import_state("new-run", bad, with_optimizer=True)
    assert same_weights(sharded.weights("keep"), before)
    assert not sharded.has("new-run")
    with pytest.raises(NotFound):
        sharded.optim_step("missing", HP)


def test_parking_every_rank_and_restoring_is_bitwise(sharded):
    sharded.create("p")
    train(sharded, "p", range(1))
    sharded.import_state("twin", sharded.export_state("p"), with_optimizer=True)
    before = sharded.weights("p")
    seconds, nbytes = sharded.park("p")
    assert sharded.is_parked("p") and nbytes >= sum(sharded.local_bytes("twin")) * 3 // 4  # no gradients now
    assert sharded.restore("p")[1] == nbytes and not sharded.is_parked("p")
    assert same_weights(sharded.weights("p"), before)
    assert train(sharded, "p", range(1, 3)) == train(sharded, "twin", range(1, 3))
    assert same_weights(sharded.weights("p"), sharded.weights("twin"))


def test_export_and_sampler_weights_come_from_the_gathered_weights(sharded, tmp_path):
    sharded.create("x")
    train(sharded, "x", range(1))
    weights = sharded.weights("x")
    for name, content in sharded.export_external("x").items():
        (tmp_path / name).write_bytes(content)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    loaded = dict(model.named_parameters())
    assert loaded.keys() == weights.keys()
    for key, tensor in weights.items():
        assert torch.equal(loaded[key].detach(), tensor), key
    blobs: dict[str, bytes] = {}

    def put(content: bytes) -> BlobRef:
        ref = BlobRef(sha256=hashlib.sha256(content).hexdigest(), size=len(content))
        blobs[ref.sha256] = content
        return ref

    publication = sharded.publish("x", 1, put)
    receiver = Receiver({k: torch.nn.Parameter(torch.zeros(v.shape), requires_grad=False) for k, v in weights.items()},
                        "bfloat16")  # fmt: skip
    receiver.update(read_manifest(blobs[publication.manifest.sha256]), lambda ref: blobs[ref.sha256])
    for key, tensor in weights.items():
        have = receiver.params[key].detach().to(torch.bfloat16).view(torch.int16)
        assert torch.equal(have, tensor.to(torch.bfloat16).view(torch.int16)), key


def test_a_killed_rank_is_fatal_to_the_group_and_says_so(sharded):
    """Last: it ends the module's engine. The served trainer's hook exits the process (its
    replacement recovers by replay: tests/e2e/test_sharded_recovery.py)."""
    sharded.create("k")
    os.kill(sharded.pids[1], signal.SIGKILL)
    # Found while idle (the watch thread), before any request: the hook runs once.
    deadline = time.monotonic() + 30
    while not lost and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(lost) == 1 and "rank 1 of 2 is gone" in str(lost[0])
    for process in sharded._ranks:
        process.join(timeout=10)
        assert not process.is_alive()
    with pytest.raises(RankLost, match="rank 1 of 2 is gone"):
        train(sharded, "k", range(1))
    assert len(lost) == 1
