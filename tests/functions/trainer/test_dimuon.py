"""Dimuon (functions/trainer/dimuon.py) against a float64 numpy reference written from its
docstring, plus its state: files, parking, export/import, and the family checks.

The reference is independent of the implementation's code: numpy, float64, the iteration
written from Keller Jordan's definition, and the direction's norm taken from the SVD where
the implementation takes the Frobenius norm (the two agree: ||X||_F^2 = sum of sigma^2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functions.trainer import dimuon, optimizer
from functions.trainer.engine import TrainerEngine
from openrl_core.errors import InvalidRequest
from openrl_core.params import AdamParams, DimuonParams, LoraConfig, check_optimizer_config
from tests.functions.trainer.conftest import sft_batch


def reference_msign(m: np.ndarray) -> np.ndarray:
    a, b, c = 3.4445, -4.7750, 2.0315
    x = m.T if m.shape[0] > m.shape[1] else m
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if m.shape[0] > m.shape[1] else x


class ReferenceDimuon:
    def __init__(self, weights: dict[str, np.ndarray]):
        self.p = {k: v.astype(np.float64) for k, v in weights.items()}
        self.m = {k: np.zeros_like(v) for k, v in self.p.items()}

    def step(self, grads: dict[str, np.ndarray], hp: DimuonParams) -> float:
        g = {k: v.astype(np.float64) for k, v in grads.items()}
        norm = float(np.sqrt(sum(np.sum(x * x) for x in g.values())))
        if hp.grad_clip_norm > 0:
            g = {k: x * min(1.0, hp.grad_clip_norm / (norm + 1e-6)) for k, x in g.items()}
        for k in self.p:
            self.m[k] = hp.beta1 * self.m[k] + (1 - hp.beta1) * g[k]
            x = reference_msign(self.m[k])
            sigma = np.linalg.svd(x, compute_uv=False)
            if sigma.max() > 0:
                self.p[k] = self.p[k] - hp.learning_rate * x * np.sqrt(min(x.shape)) / np.sqrt(np.sum(sigma**2))
        return norm


STEPS = [
    DimuonParams(learning_rate=1e-2, beta1=0.9, grad_clip_norm=0.0),
    DimuonParams(learning_rate=3e-3, beta1=0.5, grad_clip_norm=0.05),
    DimuonParams(learning_rate=2e-2, beta1=0.0, grad_clip_norm=-1.0),  # nonpositive: no clipping
]


def test_msign_approximates_the_polar_factor_and_the_direction_has_norm_sqrt_rank():
    rng = np.random.default_rng(0)
    for shape in ((4, 64), (64, 4), (8, 8)):
        m = rng.standard_normal(shape)
        u, _, vt = np.linalg.svd(m, full_matrices=False)
        polar = u @ vt
        x = dimuon.msign(torch.tensor(m, dtype=torch.float32)).double().numpy()
        np.testing.assert_allclose(x, reference_msign(m), rtol=1e-4, atol=1e-5)
        cosine = np.sum(x * polar) / (np.linalg.norm(x) * np.linalg.norm(polar))
        assert cosine > 0.97, cosine  # an approximate matrix sign, as Newton-Schulz gives
        sigma = np.linalg.svd(x, compute_uv=False)
        assert 0.6 < sigma.min() and sigma.max() < 1.25, sigma
        d = dimuon.direction(torch.tensor(m, dtype=torch.float32))
        assert float(torch.linalg.matrix_norm(d)) == pytest.approx(np.sqrt(min(shape)), rel=1e-5)
    assert not dimuon.direction(torch.zeros(4, 16)).any()  # zero momentum: no step, no NaN


def test_engine_dimuon_steps_match_the_reference(engine):
    engine.create_adapter("m", LoraConfig(rank=4, seed=3), "dimuon")
    batch = sft_batch(0, [7, 12])
    reference = ReferenceDimuon(engine.adapter_weights("m"))
    clip_bound = False
    for hp in STEPS:
        engine.forward_backward("m", batch, "cross_entropy", None, forward_only=False)
        grads = engine.adapter_gradients("m")
        metrics = engine.optim_step("m", hp)
        expected_norm = reference.step(grads, hp)
        clip_bound |= 0 < hp.grad_clip_norm < expected_norm
        assert metrics == pytest.approx({"optim/grad_norm": expected_norm, "optim/lr": hp.learning_rate}, rel=1e-5)
        for key, value in engine.adapter_weights("m").items():
            np.testing.assert_allclose(value, reference.p[key], rtol=1e-4, atol=2e-6, err_msg=key)
        assert all(not g.any() for g in engine.adapter_gradients("m").values())
    assert clip_bound, "the test must exercise a binding grad_clip_norm"
    assert engine._adapters["m"].adam.step == 3


def test_families_are_not_mixed_and_configs_are_checked(engine):
    engine.create_adapter("d", LoraConfig(rank=4, seed=1), "dimuon")
    engine.create_adapter("a", LoraConfig(rank=4, seed=1))
    with pytest.raises(InvalidRequest, match="dimuon optimizer .* needs DimuonParams"):
        engine.optim_step("d", AdamParams())
    with pytest.raises(InvalidRequest, match="adamw optimizer .* needs AdamParams"):
        engine.optim_step("a", DimuonParams(learning_rate=1e-3))
    assert check_optimizer_config(None) == {"type": "adamw"}
    assert check_optimizer_config({"type": "dimuon"}) == {"type": "dimuon", "version": 1}
    for bad in ({"type": "sgd"}, {"type": "dimuon", "version": 2}, {"type": "adamw", "lr": 1}):
        with pytest.raises(ValueError):
            check_optimizer_config(bad)


def _trained(tiny_files, steps: int) -> TrainerEngine:
    engine = TrainerEngine(tiny_files)
    engine.create_adapter("m", LoraConfig(rank=4, seed=5), "dimuon")
    for step in range(steps):
        engine.forward_backward("m", sft_batch(step, [6, 9]), "cross_entropy", None, forward_only=False)
        engine.optim_step("m", DimuonParams(learning_rate=5e-3 * (step + 1), beta1=0.8))
    return engine


def test_state_files_park_and_import_continue_bitwise(tiny_files):
    """save_state/load_state and parking: the run continues bitwise as if never interrupted."""
    straight = _trained(tiny_files, 3)
    interrupted = _trained(tiny_files, 2)
    files = interrupted.export_state("m")
    meta = files[optimizer.STATE_META].decode()
    assert '"format": "openrl.dimuon.v1"' in meta and '"step": 2' in meta
    interrupted.park("m")
    assert interrupted.is_parked("m")
    interrupted.restore("m")
    loaded = TrainerEngine(tiny_files)
    loaded.import_state("m", files, with_optimizer=True)  # creates the adapter from the files
    assert isinstance(loaded._adapters["m"].adam, dimuon.DimuonState)
    for engine in (interrupted, loaded):
        engine.forward_backward("m", sft_batch(2, [6, 9]), "cross_entropy", None, forward_only=False)
        engine.optim_step("m", DimuonParams(learning_rate=1.5e-2, beta1=0.8))
    for engine in (interrupted, loaded):
        for key, value in straight.adapter_weights("m").items():
            np.testing.assert_array_equal(engine.adapter_weights("m")[key], value, err_msg=key)
        for key, value in straight._adapters["m"].adam.momentum.items():
            assert torch.equal(engine._adapters["m"].adam.momentum[key], value), key
    # without the optimizer, the momentum restarts at zero and the family stays Dimuon
    fresh = TrainerEngine(tiny_files)
    fresh.create_adapter("m", LoraConfig(rank=4, seed=5), "dimuon")
    fresh.import_state("m", files, with_optimizer=False)
    state = fresh._adapters["m"].adam
    assert isinstance(state, dimuon.DimuonState) and state.step == 0
    assert not any(t.any() for t in state.momentum.values())


def test_bad_state_files_are_refused():
    params = {"x.lora_A.weight": torch.nn.Parameter(torch.zeros(2, 3))}
    state = optimizer.fresh_state(params, "dimuon")
    params["x.lora_A.weight"].grad = torch.ones(2, 3)
    optimizer.step(params, state, DimuonParams(learning_rate=1e-2))
    files = optimizer.state_to_files(state)
    restored = optimizer.state_from_files(files, params)
    assert isinstance(restored, dimuon.DimuonState) and restored.step == 1
    assert torch.equal(restored.momentum["x.lora_A.weight"], state.momentum["x.lora_A.weight"])
    with pytest.raises(InvalidRequest, match="does not match"):
        optimizer.state_from_files(files, {"other": torch.nn.Parameter(torch.zeros(2, 3))})
    with pytest.raises(InvalidRequest, match="shape"):
        optimizer.state_from_files(files, {"x.lora_A.weight": torch.nn.Parameter(torch.zeros(3, 2))})
    with pytest.raises(InvalidRequest, match="matrices"):
        optimizer.fresh_state({"bias": torch.nn.Parameter(torch.zeros(3))}, "dimuon")
