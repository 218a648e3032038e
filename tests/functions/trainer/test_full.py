"""Full fine-tuning on the real tiny Qwen3: bitwise the same steps done with plain torch,
state round trips, parking, exports that transformers loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functions.compute.models import load_causal_lm
from functions.trainer.full import FullFinetuneEngine
from openrl_core.errors import InvalidRequest, NotFound
from openrl_core.params import AdamParams
from tests.functions.trainer.conftest import sft_batch

STEPS = [
    AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=0.0),
    AdamParams(learning_rate=3e-4, beta1=0.5, beta2=0.99, eps=1e-6, weight_decay=0.0, grad_clip_norm=0.5),
    AdamParams(learning_rate=2e-3, beta1=0.8, beta2=0.9, eps=1e-12, weight_decay=0.3, grad_clip_norm=1e6),
]


def reference_steps(files, batches, steps):
    """The same training written directly with torch and transformers: the model's own forward
    on each datum alone (in order of length, as the trainer's microbatches run), the Tinker
    cross-entropy sum, backward, then torch.optim.AdamW (gradients clipped by torch's own
    clip_grad_norm_) with each step's hyperparameters."""
    model = load_causal_lm(files)
    model.eval()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    losses = []
    for batch, hp in zip(batches, steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for datum in sorted(batch, key=lambda d: d.tokens_N.size):
            ids = torch.from_numpy(datum.tokens_N)[None]
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
            targets = torch.from_numpy(datum.loss_fn_inputs["target_tokens"])
            logprobs = logits.gather(-1, targets[:, None])[:, 0] - logits.logsumexp(-1)
            loss = torch.zeros(()) + -(logprobs * torch.from_numpy(datum.loss_fn_inputs["weights"])).sum()
            loss.backward()
            total += float(loss.detach())
        if hp.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, hp.grad_clip_norm)
        for group in optimizer.param_groups:
            group.update(lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay)
        optimizer.step()
        losses.append(total)
    return model, losses


def test_full_finetuning_steps_are_bitwise_plain_torch(tiny_files):
    batches = [sft_batch(step, [5, 9, 14]) for step in range(len(STEPS))]
    engine = FullFinetuneEngine(tiny_files)
    engine.create("m")
    losses = []
    for batch, hp in zip(batches, STEPS):
        losses.append(
            engine.forward_backward("m", batch, "cross_entropy", None, forward_only=False).metrics["loss:sum"]
        )
        engine.optim_step("m", hp)
    reference, expected_losses = reference_steps(tiny_files, batches, STEPS)
    weights = engine.weights("m")
    named = dict(reference.named_parameters())
    assert set(weights) == set(named)
    mismatched = {k: int((weights[k] != named[k].detach()).sum()) for k in weights}
    assert sum(mismatched.values()) == 0, {k: v for k, v in mismatched.items() if v}
    assert losses == pytest.approx(expected_losses, rel=1e-6)
    assert engine.adam_state("m").step == 3
    # the embedding is tied to the output layer: still one parameter after training
    assert reference.get_output_embeddings().weight is reference.get_input_embeddings().weight


def test_state_round_trips_with_and_without_optimizer_and_refuses_lora_files(tiny_files):
    engine = FullFinetuneEngine(tiny_files)
    engine.create("a")
    engine.forward_backward("a", sft_batch(1, [6, 11]), "cross_entropy", None, forward_only=False)
    engine.optim_step("a", STEPS[0])
    files = engine.export_state("a")
    engine.import_state("b", files, with_optimizer=True)
    for key, value in engine.weights("a").items():
        assert torch.equal(engine.weights("b")[key], value)
    assert engine.adam_state("b").step == 1
    engine.import_state("c", files, with_optimizer=False)
    assert engine.adam_state("c").step == 0
    # both continue identically when both have the optimizer
    for model_id in ("a", "b"):
        engine.forward_backward(model_id, sft_batch(2, [7]), "cross_entropy", None, forward_only=False)
        engine.optim_step(model_id, STEPS[1])
    for key, value in engine.weights("a").items():
        assert torch.equal(engine.weights("b")[key], value)
    with pytest.raises(InvalidRequest, match="LoRA checkpoint"):
        engine.import_state("a", {"adapter_config.json": b"{}", "adapter_model.safetensors": b""}, with_optimizer=False)
    with pytest.raises(NotFound):
        engine.optim_step("nope", STEPS[0])
    assert not engine.has("d")
    broken = dict(files)
    broken["model.safetensors"] = b"not safetensors"
    with pytest.raises(InvalidRequest, match="unreadable"):
        engine.import_state("d", broken, with_optimizer=False)
    assert not engine.has("d"), "a refused load creates nothing"


def test_parking_moves_weights_gradients_and_moments_and_restores_them_bitwise(tiny_files):
    engine = FullFinetuneEngine(tiny_files)
    engine.create("m")
    engine.forward_backward("m", sft_batch(3, [8]), "cross_entropy", None, forward_only=False)
    engine.optim_step("m", STEPS[0])
    engine.forward_backward("m", sft_batch(4, [8]), "cross_entropy", None, forward_only=False)  # gradients pending
    run = engine._runs["m"]
    before = {k: (p.detach().clone(), p.grad.clone()) for k, p in run.params.items()}
    moments = {k: t.clone() for k, t in run.adam.exp_avg_sq.items()}
    seconds, nbytes = engine.park("m")
    assert nbytes == engine.state_bytes("m") == 16 * sum(v[0].numel() for v in before.values())
    assert seconds >= 0 and engine.is_parked("m")
    assert all(p.numel() == 0 for p in run.params.values()), "the device copies are freed"
    assert engine.park("m") == (0.0, 0)
    engine.restore("m")
    for key, (value, grad) in before.items():
        assert torch.equal(run.params[key], value) and torch.equal(run.params[key].grad, grad)
    for key, value in moments.items():
        assert torch.equal(run.adam.exp_avg_sq[key], value)
    engine.optim_step("m", STEPS[0])  # and training goes on


def test_the_external_export_is_a_model_directory_transformers_loads(tiny_files, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = FullFinetuneEngine(tiny_files)
    engine.create("m")
    engine.forward_backward("m", sft_batch(5, [9]), "cross_entropy", None, forward_only=False)
    engine.optim_step("m", STEPS[0])
    for name, content in engine.export_external("m").items():
        (tmp_path / name).write_bytes(content)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True, dtype=torch.float32)
    weights = engine.weights("m")
    for key, param in loaded.named_parameters():
        assert torch.equal(param.detach(), weights[key]), key
    assert AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)("hello")["input_ids"]


def test_forward_only_matches_the_plain_model_and_leaves_no_gradient(tiny_files):
    engine = FullFinetuneEngine(tiny_files)
    engine.create("m")
    batch = sft_batch(6, [4, 10])
    result = engine.forward_backward("m", batch, "cross_entropy", None, forward_only=True)
    model = load_causal_lm(tiny_files)
    for datum, got in zip(batch, result.logprobs):
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(datum.tokens_N)[None]).logits[0].double()
        want = torch.log_softmax(logits, -1).numpy()[np.arange(len(got)), datum.loss_fn_inputs["target_tokens"]]
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    assert all(p.grad is None for p in engine._runs["m"].params.values())
