"""AdamW against a float64 numpy reference written from torch's AdamW definition.

Every `AdamParams` field is exercised, over several steps (so bias correction and the moment
buffers matter), with gradient clipping both idle and triggered.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functions.trainer import optimizer
from openrl_core.errors import InvalidRequest
from openrl_core.params import AdamParams, LoraConfig
from tests.functions.trainer.conftest import sft_batch


class ReferenceAdamW:
    """Plain numpy AdamW in float64: the textbook m-hat / v-hat form, not torch's rearrangement."""

    def __init__(self, weights: dict[str, np.ndarray]):
        self.p = {k: v.astype(np.float64) for k, v in weights.items()}
        self.m = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.t = 0

    def step(self, grads: dict[str, np.ndarray], hp: AdamParams) -> float:
        g = {k: v.astype(np.float64) for k, v in grads.items()}
        norm = float(np.sqrt(sum(np.sum(x * x) for x in g.values())))
        if hp.grad_clip_norm > 0:
            coefficient = min(1.0, hp.grad_clip_norm / (norm + 1e-6))
            g = {k: x * coefficient for k, x in g.items()}
        self.t += 1
        for k in self.p:
            self.p[k] = self.p[k] * (1 - hp.learning_rate * hp.weight_decay)
            self.m[k] = hp.beta1 * self.m[k] + (1 - hp.beta1) * g[k]
            self.v[k] = hp.beta2 * self.v[k] + (1 - hp.beta2) * g[k] ** 2
            m_hat = self.m[k] / (1 - hp.beta1**self.t)
            v_hat = self.v[k] / (1 - hp.beta2**self.t)
            self.p[k] = self.p[k] - hp.learning_rate * m_hat / (np.sqrt(v_hat) + hp.eps)
        return norm


STEPS = [
    AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.0),
    AdamParams(learning_rate=3e-3, beta1=0.5, beta2=0.99, eps=1e-3, weight_decay=0.0, grad_clip_norm=0.05),
    AdamParams(learning_rate=2e-2, beta1=0.8, beta2=0.9, eps=1e-12, weight_decay=0.3, grad_clip_norm=100.0),
]


def test_adamw_step_matches_reference_on_synthetic_tensors():
    rng = np.random.default_rng(0)
    shapes = {"a": (4, 6), "b": (6, 4)}
    params = {k: torch.nn.Parameter(torch.tensor(rng.normal(size=s), dtype=torch.float32)) for k, s in shapes.items()}
    reference = ReferenceAdamW({k: p.detach().numpy() for k, p in params.items()})
    state = optimizer.fresh_state(params)
    binding = []
    for hp in STEPS:
        grads = {k: rng.normal(scale=0.5, size=s).astype(np.float32) for k, s in shapes.items()}
        for k, p in params.items():
            p.grad = torch.tensor(grads[k])
        norm = optimizer.adamw_step(params, state, hp)
        expected_norm = reference.step(grads, hp)
        binding.append(0 < hp.grad_clip_norm < expected_norm)
        np.testing.assert_allclose(norm, expected_norm, rtol=1e-6)
        for k, p in params.items():
            np.testing.assert_allclose(p.detach().numpy(), reference.p[k], rtol=1e-5, atol=1e-6)
    assert state.step == 3
    assert binding == [False, True, False]


def test_missing_gradient_steps_as_zero():
    params = {"w": torch.nn.Parameter(torch.ones(3))}
    state = optimizer.fresh_state(params)
    optimizer.adamw_step(params, state, AdamParams(learning_rate=0.1, weight_decay=0.5))
    np.testing.assert_allclose(params["w"].detach().numpy(), np.full(3, 1 - 0.1 * 0.5), rtol=1e-6)
    assert state.step == 1


def test_state_files_round_trip_and_refuse_mismatches():
    params = {"x.lora_A.weight": torch.nn.Parameter(torch.zeros(2, 3))}
    state = optimizer.fresh_state(params)
    params["x.lora_A.weight"].grad = torch.ones(2, 3)
    optimizer.adamw_step(params, state, AdamParams())
    files = optimizer.state_to_files(state)
    restored = optimizer.state_from_files(files, params)
    assert restored.step == 1
    key = "x.lora_A.weight"
    torch.testing.assert_close(restored.exp_avg_sq[key], state.exp_avg_sq[key], rtol=0, atol=0)
    with pytest.raises(InvalidRequest):
        optimizer.state_from_files(files, {"other": torch.nn.Parameter(torch.zeros(2, 3))})
    with pytest.raises(InvalidRequest):
        optimizer.state_from_files({}, params)


def test_engine_optim_step_matches_reference_adamw(engine):
    """forward_backward + optim_step over three steps equals numpy AdamW fed the same gradients."""
    engine.create_adapter("m", LoraConfig(rank=4, seed=3))
    batch = sft_batch(0, [7, 12])
    reference = ReferenceAdamW(engine.adapter_weights("m"))
    clip_bound = False
    for hp in STEPS:
        engine.forward_backward("m", batch, "cross_entropy", None, forward_only=False)
        grads = engine.adapter_gradients("m")
        metrics = engine.optim_step("m", hp)
        expected_norm = reference.step(grads, hp)
        clip_bound |= 0 < hp.grad_clip_norm < expected_norm
        assert metrics == pytest.approx({"optim/grad_norm": expected_norm, "optim/lr": hp.learning_rate}, rel=1e-5)
        weights = engine.adapter_weights("m")
        for key, value in weights.items():
            np.testing.assert_allclose(value, reference.p[key], rtol=1e-5, atol=1e-6, err_msg=key)
        assert all(not g.any() for g in engine.adapter_gradients("m").values()), "optim_step clears gradients"
    assert clip_bound, "the test must exercise a binding grad_clip_norm"


def _per_tensor_step(params, state, hp):
    """The update one tensor at a time, line by line as torch's single-tensor AdamW does it
    (with torch's clip_grad_norm_ rule in front): what `adamw_step` must equal bitwise."""
    with torch.no_grad():
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in params.items()}
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        if hp.grad_clip_norm > 0:
            coefficient = torch.clamp(hp.grad_clip_norm / (norm + optimizer.CLIP_EPSILON), max=1.0)
            grads = {n: g * coefficient for n, g in grads.items()}
        state.step += 1
        bc2_sqrt = (1.0 - hp.beta2**state.step) ** 0.5
        step_size = hp.learning_rate / (1.0 - hp.beta1**state.step)
        for n in sorted(params):
            p, g, m, v = params[n], grads[n], state.exp_avg[n], state.exp_avg_sq[n]
            p.mul_(1.0 - hp.learning_rate * hp.weight_decay)
            m.lerp_(g, 1.0 - hp.beta1)
            v.mul_(hp.beta2).addcmul_(g, g, value=1.0 - hp.beta2)
            p.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(hp.eps), value=-step_size)
        return float(norm)


def test_adamw_step_is_bitwise_the_per_tensor_update_and_torch_adamw():
    rng = np.random.default_rng(1)
    # Many tensors, not in sorted order: the norm must sum in the caller's order, as
    # clip_grad_norm_ does (in sorted order its bits differ here).
    shapes = {"b.lora_A": (8, 49152), "a.lora_B": (1536, 8), "c": (3,), "a.lora_A": (8, 576), "d.lora_B": (192, 8)}
    shapes.update({f"layer.{i:02d}": (int(n), 8) for i, n in zip(range(60, 0, -1), rng.integers(1, 600, size=60))})
    start = {k: rng.normal(scale=0.1, size=s).astype(np.float32) for k, s in shapes.items()}
    ours = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in start.items()}
    mine = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in start.items()}
    theirs = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in start.items()}
    ours_state, mine_state = optimizer.fresh_state(ours), optimizer.fresh_state(mine)
    for step, hp in enumerate(STEPS * 2):
        grads = {k: rng.normal(scale=0.5, size=s).astype(np.float32) for k, s in shapes.items()}
        for group in (ours, mine, theirs):
            for k, p in group.items():
                p.grad = None if (k == "c" and step == 1) else torch.tensor(grads[k])  # one missing gradient
        assert optimizer.adamw_step(ours, ours_state, hp) == _per_tensor_step(mine, mine_state, hp)
        for k in shapes:
            assert torch.equal(ours[k], mine[k]), k
            assert torch.equal(ours_state.exp_avg[k], mine_state.exp_avg[k]) and torch.equal(
                ours_state.exp_avg_sq[k], mine_state.exp_avg_sq[k]
            )
    # torch's own AdamW (single-tensor path), without clipping, which it does not do itself
    hp = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.0)
    reference = torch.optim.AdamW(list(theirs.values()), lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                                  weight_decay=hp.weight_decay, foreach=False)  # fmt: skip
    fresh = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in start.items()}
    fresh_state = optimizer.fresh_state(fresh)
    for _ in range(3):
        grads = {k: rng.normal(scale=0.5, size=s).astype(np.float32) for k, s in shapes.items()}
        for group in (fresh, theirs):
            for k, p in group.items():
                p.grad = torch.tensor(grads[k])
        optimizer.adamw_step(fresh, fresh_state, hp)
        reference.step()
    for k in shapes:
        assert torch.equal(fresh[k], theirs[k]), k
        assert not torch.equal(fresh[k], torch.tensor(start[k]))
