"""Several LoRA models in shared passes: every model's losses, logprobs and gradients bitwise
those of its request run alone (tiny Qwen3 and SmolLM2, several ranks, losses and lengths),
and a bad request fails alone."""

from __future__ import annotations

import numpy as np
import pytest

from functions.trainer.engine import PackRequest, TrainerEngine
from openrl_core.errors import InvalidRequest, NotFound
from openrl_core.params import AdamParams, LoraConfig
from tests.functions.trainer.conftest import sft_batch

MODELS = {"a": LoraConfig(rank=4, seed=1), "b": LoraConfig(rank=8, seed=2), "c": LoraConfig(rank=32, seed=3, train_unembed=False),
          "d": LoraConfig(rank=1, seed=4, train_mlp=False)}  # fmt: skip


def rl_batch(seed: int, lengths: list[int]):
    rng = np.random.default_rng(seed)
    batch = sft_batch(seed, lengths)
    for datum in batch:
        n = datum.tokens_N.size
        datum.loss_fn_inputs.pop("weights")
        datum.loss_fn_inputs["logprobs"] = rng.uniform(-9, -7, n).astype(np.float32)
        datum.loss_fn_inputs["advantages"] = rng.normal(size=n).astype(np.float32)
    return batch


def requests():
    return [
        PackRequest("a", sft_batch(1, [7, 9, 33]), "cross_entropy", None, False),
        PackRequest("b", rl_batch(2, [12, 5, 20, 40]), "importance_sampling", None, False),
        PackRequest(
            "c", rl_batch(3, [30, 31, 16]), "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, False
        ),
        PackRequest("d", sft_batch(4, [31, 2]), "cross_entropy", None, True),  # forward only
        PackRequest("a", rl_batch(5, [17, 8]), "cispo", None, False),  # a's second request, after its first
    ]


def fresh(files, max_tokens=8192, shared_bytes=1 << 30, device="cpu"):
    engine = TrainerEngine(files, device=device, max_padded_tokens=max_tokens, max_shared_pass_bytes=shared_bytes)
    for name, lora in MODELS.items():
        engine.create_adapter(name, lora)
    return engine


def check_packed_equals_alone(files, max_tokens, shared_bytes=1 << 30):
    alone = fresh(files, max_tokens)
    expected = [
        alone.forward_backward(r.model_id, r.batch, r.loss_fn, r.loss_fn_config, r.forward_only) for r in requests()
    ]
    packed = fresh(files, max_tokens, shared_bytes)
    got = packed.forward_backward_many(requests())
    for want, have in zip(expected, got):
        assert have.metrics == want.metrics
        for x, y in zip(want.logprobs, have.logprobs):
            assert np.array_equal(x, y)
    for name in MODELS:
        want, have = alone.adapter_gradients(name), packed.adapter_gradients(name)
        for key in want:
            assert np.array_equal(want[key], have[key]), (name, key)
    assert not any(np.any(g) for g in packed.adapter_gradients("d").values()), "forward-only adds no gradient"
    for engine in (alone, packed):  # and the optimizer steps that follow are the same too
        for name in "abc":
            engine.optim_step(name, AdamParams(learning_rate=1e-2))
    for name in "abc":
        for key, value in alone.adapter_weights(name).items():
            assert np.array_equal(value, packed.adapter_weights(name)[key])


# 64: units split, requests spread over passes; a small shared budget: fewer units share a pass
@pytest.mark.parametrize("max_tokens, shared_bytes", [(8192, 1 << 30), (64, 1 << 30), (8192, 1 << 26)])
def test_packed_requests_are_bitwise_alone_on_the_tiny_model(tiny_files, max_tokens, shared_bytes):
    check_packed_equals_alone(tiny_files, max_tokens, shared_bytes)


@pytest.mark.slow
def test_packed_requests_are_bitwise_alone_on_smollm2(smol_files):
    check_packed_equals_alone(smol_files, 8192)


def test_a_bad_request_fails_alone(tiny_files):
    engine = fresh(tiny_files)
    batch = sft_batch(6, [9])
    bad_tokens = sft_batch(7, [5])
    bad_tokens[0].loss_fn_inputs["target_tokens"][0] = 10**9
    results = engine.forward_backward_many([
        PackRequest("a", batch, "cross_entropy", None, False),
        PackRequest("b", bad_tokens, "cross_entropy", None, False),
        PackRequest("c", batch, "ppo", {"beta": 1.0}, False),  # a key ppo does not use
        PackRequest("nope", batch, "cross_entropy", None, False),
        PackRequest("d", batch, "cross_entropy", None, False),
    ])  # fmt: skip
    assert isinstance(results[1], InvalidRequest) and isinstance(results[2], InvalidRequest)
    assert isinstance(results[3], NotFound)
    alone = fresh(tiny_files)
    for index, name in ((0, "a"), (4, "d")):
        want = alone.forward_backward(name, batch, "cross_entropy", None, False)
        assert results[index].metrics == want.metrics
    assert not any(np.any(g) for g in engine.adapter_gradients("b").values())
