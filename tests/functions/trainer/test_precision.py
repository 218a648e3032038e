"""The bf16 precision policy on CPU against the float32 reference, and activation checkpointing.

Tolerances, stated once (bf16 keeps 8 bits of mantissa; measured on the tiny Qwen3 at about a
fifth of each bound, 3 steps of SFT on 3 sequences):
- summed losses: relative 2e-4;
- per-token logprobs: absolute 0.03;
- gradients: relative L2 error 5e-2 over the whole adapter or model;
- weights after AdamW steps: every element within 2 x lr x steps (Adam normalises each
  gradient, so where one is near zero bf16 noise can flip the step's sign), and at most 2% of
  them further apart than lr / 10.
The float32 path (the reference) is itself tested bitwise against plain torch in
test_engine.py and test_full.py; a full bf16 step's loss is also checked against a plain
torch autocast forward written out here. Checkpointing recomputes the same arithmetic, so
with it the float32 numbers are bitwise those without it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functions.compute.models import load_causal_lm
from functions.trainer.engine import PackRequest, TrainerEngine
from functions.trainer.full import FullFinetuneEngine
from functions.trainer.precision import Precision
from openrl_core.errors import InvalidRequest
from openrl_core.params import AdamParams, LoraConfig
from tests.functions.trainer.conftest import sft_batch
from tests.functions.trainer.test_memory_measured import saved_bytes

STEPS = 3
LENGTHS = [5, 17, 33]


def relative_l2(have: dict, want: dict) -> float:
    diff = sum(((np.asarray(have[k], np.float64) - np.asarray(want[k], np.float64)) ** 2).sum() for k in want)
    norm = sum((np.asarray(want[k], np.float64) ** 2).sum() for k in want)
    return float(np.sqrt(diff / norm))


def lora_steps(files, precision: Precision, lr=1e-3, device="cpu"):
    engine = TrainerEngine(files, device=device, precision=precision)
    engine.create_adapter("m", LoraConfig(rank=8, seed=3))
    steps = []
    for step in range(STEPS):
        result = engine.forward_backward("m", sft_batch(step, LENGTHS), "cross_entropy", None, False)
        steps.append((result.metrics["loss:sum"], np.concatenate(result.logprobs), engine.adapter_gradients("m")))
        engine.optim_step("m", AdamParams(learning_rate=lr))
    return engine, steps, engine.adapter_weights("m")


def full_steps(files, precision: Precision, lr=1e-4, device="cpu"):
    engine = FullFinetuneEngine(files, device=device, precision=precision)
    engine.create("r")
    steps = []
    for step in range(STEPS):
        result = engine.forward_backward("r", sft_batch(step, LENGTHS), "cross_entropy", None, False)
        grads = {k: p.grad.detach().cpu().clone().numpy() for k, p in engine._runs["r"].params.items()}
        steps.append((result.metrics["loss:sum"], np.concatenate(result.logprobs), grads))
        engine.optim_step("r", AdamParams(learning_rate=lr))
    return engine, steps, {k: v.cpu().numpy() for k, v in engine.weights("r").items()}


def assert_close_to_reference(bf16, reference, lr):
    (_, steps, weights), (_, want_steps, want_weights) = bf16, reference
    for (loss, logprobs, grads), (want_loss, want_logprobs, want_grads) in zip(steps, want_steps):
        assert abs(loss - want_loss) <= 2e-4 * abs(want_loss)
        assert np.abs(logprobs - want_logprobs).max() <= 0.03
        assert relative_l2(grads, want_grads) <= 5e-2
    moved = np.concatenate([np.abs(weights[k].astype(np.float64) - want_weights[k]).ravel() for k in want_weights])
    assert moved.max() <= 2 * lr * STEPS
    assert np.mean(moved > lr / 10) <= 0.02


def test_settings_resolve_by_device():
    assert Precision.resolve("auto", "cpu") == Precision("float32")
    assert Precision.resolve("auto", "cuda:1", activation_checkpointing=True) == Precision("bfloat16", True)
    assert Precision.resolve("bfloat16", "cpu").base_dtype == torch.bfloat16
    with pytest.raises(InvalidRequest):
        Precision.resolve("float16", "cpu")


def test_lora_in_bf16_follows_the_float32_reference(tiny_files):
    bf16 = lora_steps(tiny_files, Precision("bfloat16"))
    assert_close_to_reference(bf16, lora_steps(tiny_files, Precision("float32")), lr=1e-3)
    engine = bf16[0]
    adapter = engine._adapters["m"]
    # The base is bf16 and frozen; everything trained is float32.
    assert {p.dtype for n, p in engine._base.named_parameters() if "lora_" not in n} == {torch.bfloat16}
    assert {p.dtype for p in adapter.params.values()} == {torch.float32}
    assert {t.dtype for t in [*adapter.adam.exp_avg.values(), *adapter.adam.exp_avg_sq.values()]} == {torch.float32}
    assert engine._base.config._attn_implementation == "sdpa"


def test_full_in_bf16_follows_the_float32_reference(tiny_files):
    bf16 = full_steps(tiny_files, Precision("bfloat16"))
    assert_close_to_reference(bf16, full_steps(tiny_files, Precision("float32")), lr=1e-4)
    run = bf16[0]._runs["r"]
    assert {p.dtype for p in run.params.values()} == {torch.float32}  # master weights
    assert {t.dtype for t in [*run.adam.exp_avg.values(), *run.adam.exp_avg_sq.values()]} == {torch.float32}


def test_a_full_bf16_loss_is_plain_torch_under_autocast(tiny_files):
    """Independent reference: the HF model's logits under torch.autocast, log-softmax in float32."""
    batch = sft_batch(5, [7, 12])
    engine = FullFinetuneEngine(tiny_files, precision=Precision("bfloat16"))
    engine.create("r")
    have = engine.forward_backward("r", batch, "cross_entropy", None, forward_only=True).metrics["loss:sum"]
    model = load_causal_lm(tiny_files).eval()
    want = 0.0
    with torch.no_grad():
        for datum in batch:
            ids = torch.from_numpy(np.asarray(datum.tokens_N, np.int64))[None]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=ids).logits
            logprobs = torch.log_softmax(logits.float()[0], -1)
            targets = torch.from_numpy(np.asarray(datum.loss_fn_inputs["target_tokens"], np.int64))
            want -= float(logprobs.gather(-1, targets[:, None]).sum())
    assert have == pytest.approx(want, rel=1e-3)


def test_checkpointing_is_bitwise_and_keeps_less(tiny_files):
    """float32: the same bits with and without checkpointing, packed LoRA (two models, one
    pass) and full runs alike; and the pass keeps far fewer activations."""
    results, kept = {}, {}
    for checkpointing in (False, True):
        engine = TrainerEngine(tiny_files, precision=Precision("float32", checkpointing))
        engine.create_adapter("a", LoraConfig(rank=4, seed=1))
        engine.create_adapter("b", LoraConfig(rank=8, seed=2))
        requests = [PackRequest(m, sft_batch(i, [9, 20]), "cross_entropy", None, False) for i, m in enumerate("ab")]
        out = engine.forward_backward_many(requests)
        engine.optim_step("a", AdamParams(learning_rate=1e-3))
        full = FullFinetuneEngine(tiny_files, precision=Precision("float32", checkpointing))
        full.create("r")
        batch = sft_batch(3, [30, 30])
        params = list(full._runs["r"].params.values())
        kept[checkpointing] = saved_bytes(
            lambda: full.forward_backward("r", batch, "cross_entropy", None, False), params
        )
        grads = {k: p.grad.clone() for k, p in full._runs["r"].params.items()}
        results[checkpointing] = (out, engine.adapter_weights("a"), engine.adapter_gradients("b"), grads)
    (out0, wa0, gb0, g0), (out1, wa1, gb1, g1) = results[False], results[True]
    for r0, r1 in zip(out0, out1):
        assert r0.metrics == r1.metrics
        for x, y in zip(r0.logprobs, r1.logprobs):
            np.testing.assert_array_equal(x, y)
    for key in wa0:
        np.testing.assert_array_equal(wa0[key], wa1[key])
    for key in gb0:
        np.testing.assert_array_equal(gb0[key], gb1[key])
    for key in g0:
        assert torch.equal(g0[key], g1[key]), key
    # Logits (vocabulary 151936) dominate either way; the decoder's share must shrink.
    assert kept[True] < kept[False] - 0.8 * (kept[False] - 4 * 60 * 151936)
