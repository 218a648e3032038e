"""The engine on the real tiny Qwen3: logprobs, accumulation, isolation, determinism, errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from functions.compute.models import load_causal_lm
from functions.trainer import batching
from functions.trainer.engine import TrainerEngine
from openrl_core.datum import Datum
from openrl_core.errors import Conflict, InvalidRequest, NotFound
from openrl_core.params import AdamParams, LoraConfig
from tests.functions.trainer.conftest import sft_batch

ADAM = AdamParams(learning_rate=1e-2, eps=1e-8)


def reference_logprobs(model, datum: Datum) -> np.ndarray:
    """One datum, unpadded, through the plain HF model; log-softmax in float64."""
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(datum.tokens_N)[None]).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1).numpy()
    targets = datum.loss_fn_inputs["target_tokens"]
    rows = np.arange(len(targets))
    return logprobs[rows, targets] if targets.ndim == 1 else logprobs[rows[:, None], targets]


def test_fresh_adapter_logprobs_equal_the_plain_model_on_a_padded_batch(tiny_files):
    engine = TrainerEngine(tiny_files)  # lengths 3, 11, 6, 11: one batch padded to [4, 16]
    engine.create_adapter("m", LoraConfig(rank=8, seed=0))
    rng = np.random.default_rng(1)
    tokens = [rng.integers(0, 5000, n).astype(np.int64) for n in (3, 11, 6)]
    batch = [Datum(t, {"target_tokens": rng.integers(0, 5000, len(t)).astype(np.int64)}) for t in tokens]
    batch.append(Datum(tokens[1], {"target_tokens": rng.integers(0, 151936, (11, 4)).astype(np.int64)}))  # K=4
    result = engine.forward_backward("m", batch, "cross_entropy", None, forward_only=True)
    plain = load_causal_lm(tiny_files)
    for datum, got in zip(batch, result.logprobs):
        assert got.dtype == np.float32 and got.shape == datum.loss_fn_inputs["target_tokens"].shape
        np.testing.assert_allclose(got, reference_logprobs(plain, datum), rtol=0, atol=2e-5)
    expected_loss = -sum(float(lp.sum()) for lp in result.logprobs)
    assert set(result.metrics) == {"loss:sum"}
    assert result.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5)


def test_logits_chunking_does_not_change_logprobs(engine, monkeypatch):
    engine.create_adapter("m", LoraConfig(rank=4, seed=0))
    batch = sft_batch(2, [9, 4])
    whole = engine.forward_backward("m", batch, "cross_entropy", None, forward_only=True).logprobs
    monkeypatch.setattr(batching, "LOGITS_CHUNK_ELEMENTS", 3 * 151936)  # 3 rows per chunk
    chunked = engine.forward_backward("m", batch, "cross_entropy", None, forward_only=True).logprobs
    for a, b in zip(whole, chunked):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_forward_only_leaves_no_gradient(engine):
    engine.create_adapter("m", LoraConfig(rank=4, seed=0))
    engine.forward_backward("m", sft_batch(0, [5]), "cross_entropy", None, forward_only=True)
    assert all(not g.any() for g in engine.adapter_gradients("m").values())


def test_two_half_batches_accumulate_to_the_whole_batch(engine):
    """Including across microbatches: the second adapter runs one datum per forward pass."""
    batch = sft_batch(3, [6, 10, 4, 8])
    engine.create_adapter("whole", LoraConfig(rank=4, seed=5))
    engine.create_adapter("halves", LoraConfig(rank=4, seed=5))
    whole = engine.forward_backward("whole", batch, "cross_entropy", None, forward_only=False)
    engine.limits = dataclasses.replace(engine.limits, max_tokens=1)  # one datum per microbatch for the halves
    first = engine.forward_backward("halves", batch[:2], "cross_entropy", None, forward_only=False)
    second = engine.forward_backward("halves", batch[2:], "cross_entropy", None, forward_only=False)
    assert first.metrics["loss:sum"] + second.metrics["loss:sum"] == pytest.approx(whole.metrics["loss:sum"], rel=1e-5)
    grads_whole, grads_halves = engine.adapter_gradients("whole"), engine.adapter_gradients("halves")
    for key in grads_whole:
        # float32 sums in a different order: tolerance relative to the tensor's scale
        scale = float(np.abs(grads_whole[key]).max())
        np.testing.assert_allclose(grads_halves[key], grads_whole[key], rtol=0, atol=1e-5 * scale, err_msg=key)
    # Adam's first step is lr * g / (|g| + eps): a large eps keeps it from turning float noise
    # in a near-zero gradient into a full-size step of either sign.
    smooth = AdamParams(learning_rate=1e-2, eps=1e-2)
    engine.optim_step("whole", smooth)
    engine.optim_step("halves", smooth)
    weights_whole, weights_halves = engine.adapter_weights("whole"), engine.adapter_weights("halves")
    for key in weights_whole:
        np.testing.assert_allclose(weights_halves[key], weights_whole[key], rtol=0, atol=1e-5, err_msg=key)


def test_adapters_on_one_base_do_not_interfere(tiny_files):
    batch_x, batch_y = sft_batch(4, [8, 5]), sft_batch(5, [7])
    shared = TrainerEngine(tiny_files)
    shared.create_adapter("x", LoraConfig(rank=4, seed=1, train_mlp=False, train_unembed=False))
    shared.create_adapter("y", LoraConfig(rank=16, seed=2, train_attn=False))
    shared.forward_backward("x", batch_x, "cross_entropy", None, forward_only=False)
    shared.forward_backward("y", batch_y, "cross_entropy", None, forward_only=False)
    shared.optim_step("y", ADAM)
    y_before = shared.adapter_weights("y")
    shared.optim_step("x", ADAM)
    for key, value in shared.adapter_weights("y").items():
        np.testing.assert_array_equal(value, y_before[key])

    alone = TrainerEngine(tiny_files)
    alone.create_adapter("x", LoraConfig(rank=4, seed=1, train_mlp=False, train_unembed=False))
    alone.forward_backward("x", batch_x, "cross_entropy", None, forward_only=False)
    alone.optim_step("x", ADAM)
    shared_x, alone_x = shared.adapter_weights("x"), alone.adapter_weights("x")
    assert shared_x.keys() == alone_x.keys()
    for key in alone_x:
        np.testing.assert_array_equal(shared_x[key], alone_x[key])
    probe = sft_batch(6, [6])
    np.testing.assert_array_equal(
        shared.forward_backward("x", probe, "cross_entropy", None, True).logprobs[0],
        alone.forward_backward("x", probe, "cross_entropy", None, True).logprobs[0],
    )


def test_same_calls_give_bitwise_identical_weights(tiny_files):
    runs = []
    for _ in range(2):
        engine = TrainerEngine(tiny_files)
        engine.create_adapter("m", LoraConfig(rank=4, seed=11))
        for step in range(2):
            engine.forward_backward("m", sft_batch(step, [6, 9]), "cross_entropy", None, forward_only=False)
            engine.optim_step("m", ADAM)
        runs.append(engine.adapter_weights("m"))
    for key in runs[0]:
        np.testing.assert_array_equal(runs[0][key], runs[1][key])


def test_seeded_initialisation(engine):
    engine.create_adapter("a", LoraConfig(rank=4, seed=7))
    engine.create_adapter("b", LoraConfig(rank=4, seed=7))
    engine.create_adapter("c", LoraConfig(rank=4, seed=8))
    a, b, c = (engine.adapter_weights(m) for m in "abc")
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
        if ".lora_B." in key:
            assert not a[key].any(), "B starts at zero so a fresh adapter is the base model"
        else:
            fan_in = a[key].shape[1]
            assert np.abs(a[key]).max() <= 1 / np.sqrt(fan_in) and not np.array_equal(a[key], c[key])
    # a model id that dicts of modules would refuse is fine; unseeded adapters are distinct
    engine.create_adapter("run:1/step.2", LoraConfig(rank=4))
    engine.create_adapter("run:2/step.2", LoraConfig(rank=4))
    lora_a = next(k for k in a if ".lora_A." in k)
    first, second = engine.adapter_weights("run:1/step.2"), engine.adapter_weights("run:2/step.2")
    assert not np.array_equal(first[lora_a], second[lora_a])


def test_lora_targets_follow_the_train_flags(engine):
    engine.create_adapter("attn", LoraConfig(rank=2, train_mlp=False, train_unembed=False))
    engine.create_adapter("unembed", LoraConfig(rank=2, train_mlp=False, train_attn=False))
    modules = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in engine.adapter_weights("attn")}
    assert modules == {"q_proj", "k_proj", "v_proj", "o_proj"}
    lm_head = "base_model.model.lm_head"
    assert set(engine.adapter_weights("unembed")) == {f"{lm_head}.lora_A.weight", f"{lm_head}.lora_B.weight"}


def test_rl_loss_runs_end_to_end(engine):
    engine.create_adapter("m", LoraConfig(rank=4, seed=0))
    rng = np.random.default_rng(9)
    tokens = rng.integers(0, 3000, 8).astype(np.int64)
    targets = rng.integers(0, 3000, 8).astype(np.int64)
    sample = Datum(tokens, {"target_tokens": targets})
    sampled = engine.forward_backward("m", [sample], "cross_entropy", None, forward_only=True).logprobs[0]
    inputs = {"target_tokens": targets, "logprobs": sampled, "advantages": np.linspace(-1, 1, 8).astype(np.float32)}
    config = {"clip_high_threshold": 1.1}
    result = engine.forward_backward("m", [Datum(tokens, inputs)], "ppo", config, forward_only=False)
    # on-policy, ratio 1: the PPO loss is -sum(A)
    assert result.metrics["loss:sum"] == pytest.approx(-float(inputs["advantages"].sum()), abs=1e-5)
    assert any(g.any() for g in engine.adapter_gradients("m").values())


def test_drop_and_recreate(engine):
    engine.create_adapter("m", LoraConfig(rank=4, seed=0))
    engine.drop_adapter("m")
    assert not engine.has_adapter("m")
    engine.create_adapter("m", LoraConfig(rank=8, seed=0))
    assert engine.has_adapter("m")
    engine.forward_backward("m", sft_batch(0, [4]), "cross_entropy", None, forward_only=False)
    engine.optim_step("m", ADAM)


def test_bad_calls_raise_typed_errors(engine):
    engine.create_adapter("m", LoraConfig(rank=4))
    with pytest.raises(Conflict):
        engine.create_adapter("m", LoraConfig(rank=4))
    with pytest.raises(NotFound):
        engine.forward_backward("nope", sft_batch(0, [3]), "cross_entropy", None, forward_only=True)
    with pytest.raises(NotFound):
        engine.optim_step("nope", ADAM)
    with pytest.raises(NotFound):
        engine.drop_adapter("nope")
    with pytest.raises(InvalidRequest):
        engine.forward_backward("m", sft_batch(0, [3]), "hinge", None, forward_only=True)
    with pytest.raises(InvalidRequest):
        engine.forward_backward("m", sft_batch(0, [3]), "cross_entropy", {"beta": 1.0}, forward_only=True)
    with pytest.raises(InvalidRequest):
        engine.forward_backward("m", [], "cross_entropy", None, forward_only=True)


def test_a_parked_adapter_is_restored_bitwise_while_its_neighbours_train(engine):
    engine.create_adapter("a", LoraConfig(rank=4, seed=1))
    engine.create_adapter("b", LoraConfig(rank=8, seed=2))
    assert engine.state_bytes("a") == engine.adapter_bytes_estimate(LoraConfig(rank=4))
    engine.forward_backward("a", sft_batch(7, [6]), "cross_entropy", None, forward_only=False)
    engine.optim_step("a", ADAM)
    engine.forward_backward("a", sft_batch(8, [6]), "cross_entropy", None, forward_only=False)  # pending gradients
    weights, grads = engine.adapter_weights("a"), engine.adapter_gradients("a")
    seconds, nbytes = engine.park("a")
    assert nbytes == engine.state_bytes("a") and engine.is_parked("a")
    for _ in range(2):  # b trains on the shared base meanwhile
        engine.forward_backward("b", sft_batch(9, [5]), "cross_entropy", None, forward_only=False)
        engine.optim_step("b", ADAM)
    engine.restore("a")
    for key in weights:
        np.testing.assert_array_equal(engine.adapter_weights("a")[key], weights[key])
        np.testing.assert_array_equal(engine.adapter_gradients("a")[key], grads[key])
    assert engine.base_bytes() > 0


def test_kept_and_recomputed_logits_give_bitwise_the_same_step(tiny_files, monkeypatch):
    """Small passes keep their logits for the backward, big ones recompute them (checkpoint):
    the numbers must not depend on which, or a request's bits would depend on its pass."""
    batch = sft_batch(3, [9, 4, 20])
    runs = []
    for keep in (batching.KEEP_LOGITS_ELEMENTS, 0):
        monkeypatch.setattr(batching, "KEEP_LOGITS_ELEMENTS", keep)
        monkeypatch.setattr(batching, "LOGITS_CHUNK_ELEMENTS", 16 * 151936)  # two chunks
        engine = TrainerEngine(tiny_files)
        engine.create_adapter("m", LoraConfig(rank=4, seed=0))
        result = engine.forward_backward("m", batch, "cross_entropy", None, forward_only=False)
        runs.append((result, engine.adapter_gradients("m")))
    (kept, kept_grads), (recomputed, recomputed_grads) = runs
    assert kept.metrics == recomputed.metrics
    for a, b in zip(kept.logprobs, recomputed.logprobs):
        assert np.array_equal(a, b)
    assert kept_grads.keys() == recomputed_grads.keys()
    for key in kept_grads:
        assert np.array_equal(kept_grads[key], recomputed_grads[key]), key
