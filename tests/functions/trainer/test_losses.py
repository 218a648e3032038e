"""Each built-in loss against an independent float64 numpy implementation of Tinker's formula.

Values and gradients w.r.t. the learner logprobs are checked; the reference gradients are
derived by hand (not by autograd), and the inputs are built so that ratios fall below, inside
and above the clip range with advantages of both signs.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from functions.trainer.losses import datum_loss
from openrl_core.errors import InvalidRequest
from openrl_core.losses import resolve_config

TOL = dict(rtol=1e-5, atol=1e-5)


def _reference(loss_fn: str, lp: np.ndarray, inputs: dict[str, np.ndarray], config: dict[str, float]):
    """(value, d value / d lp) of the summed loss, in float64."""
    lp = lp.astype(np.float64)
    x = {k: v.astype(np.float64) for k, v in inputs.items()}
    if loss_fn == "cross_entropy":
        w = x.get("weights", np.ones_like(lp))
        return float(np.sum(-lp * w)), -w
    q, adv = x["logprobs"], x["advantages"]
    lo = x.get("clip_low_threshold", np.full_like(lp, config.get("clip_low_threshold", np.nan)))
    hi = x.get("clip_high_threshold", np.full_like(lp, config.get("clip_high_threshold", np.nan)))
    r = np.exp(lp - q)
    if loss_fn == "importance_sampling":
        return float(np.sum(-r * adv)), -r * adv
    if loss_fn == "ppo":
        return _min_clip(r, r, adv, lo, hi)
    if loss_fn == "cispo":
        c = np.clip(r, lo, hi)
        return float(np.sum(-c * lp * adv)), -c * adv
    if loss_fn == "dro":
        beta = config["beta"]
        return float(np.sum(-(lp * adv - 0.5 * beta * (lp - q) ** 2))), -(adv - beta * (lp - q))
    if loss_fn == "gspo":
        mask = x["sequence_ratio_mask"] != 0 if "sequence_ratio_mask" in x else adv != 0
        s = np.exp(np.mean((lp - q)[mask])) if mask.any() else 1.0
        s_t = np.full_like(lp, s)
        return _min_clip(s_t, s_t, adv, lo, hi)
    raise AssertionError(loss_fn)


def _min_clip(ratio, d_ratio, adv, lo, hi):
    """-sum(min(ratio*A, clip(ratio)*A)); the clipped branch is flat in lp wherever it wins."""
    unclipped, clipped = ratio * adv, np.clip(ratio, lo, hi) * adv
    value = float(np.sum(-np.minimum(unclipped, clipped)))
    grad = np.where(unclipped <= clipped, -adv * d_ratio, 0.0)
    return value, grad


def _rl_inputs(rng: np.random.Generator, shape, with_zero_adv: bool = False):
    """(learner logprobs, {logprobs, advantages}) with ratios on both sides of [0.8, 1.2]."""
    lp = rng.uniform(-4.0, -0.1, size=shape).astype(np.float32)
    # log-ratios spread over [-0.7, 0.5]: ratios from 0.5 to 1.65 straddle [0.8, 1.2]
    log_ratio = rng.uniform(-0.7, 0.5, size=shape)
    q = (lp - log_ratio).astype(np.float32)
    adv = rng.normal(0.0, 1.0, size=shape).astype(np.float32)
    if with_zero_adv:
        adv.reshape(-1)[:3] = 0.0
    return lp, {"logprobs": q, "advantages": adv}


def _check(loss_fn: str, lp: np.ndarray, inputs: dict[str, np.ndarray], config: dict[str, float]) -> None:
    lp_t = torch.tensor(lp, requires_grad=True)
    loss = datum_loss(loss_fn, lp_t, {k: torch.tensor(v) for k, v in inputs.items()}, config)
    loss.backward()
    value, grad = _reference(loss_fn, lp, inputs, config)
    assert loss.dtype == torch.float32 and loss.ndim == 0
    np.testing.assert_allclose(float(loss.detach()), value, **TOL)
    np.testing.assert_allclose(lp_t.grad.numpy(), grad, **TOL)


@pytest.mark.parametrize("shape", [(17,), (9, 3)])
def test_cross_entropy_with_real_and_negative_weights(shape):
    rng = np.random.default_rng(0)
    lp = rng.uniform(-6, -0.01, size=shape).astype(np.float32)
    weights = rng.normal(0, 2, size=shape).astype(np.float32)  # forward_backward_custom sends any real weight
    assert (weights < 0).any() and (weights > 0).any()
    _check("cross_entropy", lp, {"weights": weights}, resolve_config("cross_entropy", None))


def test_cross_entropy_without_weights_is_plain_nll():
    lp = np.array([-1.0, -2.5, -0.25], dtype=np.float32)
    _check("cross_entropy", lp, {}, {})


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro", "gspo"])
@pytest.mark.parametrize("shape", [(40,), (12, 4)])
def test_rl_losses_match_reference(loss_fn, shape):
    rng = np.random.default_rng(zlib.crc32(f"{loss_fn}{shape}".encode()))
    lp, inputs = _rl_inputs(rng, shape, with_zero_adv=(loss_fn == "gspo"))
    _check(loss_fn, lp, inputs, resolve_config(loss_fn, None))


def test_inputs_cover_every_clip_branch():
    """Guard for the test above: ratios below, inside and above [0.8, 1.2], with A of both signs."""
    rng = np.random.default_rng(1)
    lp, inputs = _rl_inputs(rng, (40,))
    ratio = np.exp(lp - inputs["logprobs"])
    adv = inputs["advantages"]
    for region in (ratio < 0.8, (ratio > 0.8) & (ratio < 1.2), ratio > 1.2):
        assert (region & (adv > 0)).any() and (region & (adv < 0)).any()


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo", "gspo"])
def test_config_thresholds_are_used(loss_fn):
    rng = np.random.default_rng(2)
    lp, inputs = _rl_inputs(rng, (30,))
    _check(loss_fn, lp, inputs, resolve_config(loss_fn, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}))


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo", "gspo"])
def test_per_token_thresholds_override_config(loss_fn):
    rng = np.random.default_rng(3)
    lp, inputs = _rl_inputs(rng, (30,))
    # a narrow band around 1 that even GSPO's one sequence ratio falls outside of
    inputs["clip_low_threshold"] = rng.uniform(0.97, 0.99, size=30).astype(np.float32)
    inputs["clip_high_threshold"] = rng.uniform(1.01, 1.03, size=30).astype(np.float32)
    config = resolve_config(loss_fn, None)
    _check(loss_fn, lp, inputs, config)
    # and the tensors really win over the config
    without = {k: v for k, v in inputs.items() if not k.startswith("clip_")}
    assert not np.isclose(_reference(loss_fn, lp, inputs, config)[0], _reference(loss_fn, lp, without, config)[0])


def test_dro_beta_from_config():
    rng = np.random.default_rng(4)
    lp, inputs = _rl_inputs(rng, (25,))
    _check("dro", lp, inputs, resolve_config("dro", {"beta": 0.7}))


def test_gspo_uses_the_sequence_ratio_mask():
    rng = np.random.default_rng(5)
    lp, inputs = _rl_inputs(rng, (20,))
    mask = np.zeros(20, dtype=np.float32)
    mask[6:] = 1.0
    inputs["sequence_ratio_mask"] = mask
    _check("gspo", lp, inputs, resolve_config("gspo", None))


def test_gspo_without_any_ratio_position_uses_ratio_one():
    rng = np.random.default_rng(6)
    lp, inputs = _rl_inputs(rng, (8,))
    inputs["sequence_ratio_mask"] = np.zeros(8, dtype=np.float32)
    _check("gspo", lp, inputs, resolve_config("gspo", None))
    lp_t = torch.tensor(lp)
    loss = datum_loss("gspo", lp_t, {k: torch.tensor(v) for k, v in inputs.items()}, resolve_config("gspo", None))
    np.testing.assert_allclose(float(loss), -inputs["advantages"].sum(), rtol=1e-6)


def test_cispo_gradient_does_not_flow_through_the_ratio():
    lp = np.array([-1.0], dtype=np.float32)
    inputs = {"logprobs": np.array([-1.5], dtype=np.float32), "advantages": np.array([2.0], dtype=np.float32)}
    lp_t = torch.tensor(lp, requires_grad=True)
    datum_loss("cispo", lp_t, {k: torch.tensor(v) for k, v in inputs.items()}, resolve_config("cispo", None)).backward()
    ratio = np.exp(0.5)  # inside cispo's default [0, 4]
    np.testing.assert_allclose(lp_t.grad.numpy(), [-ratio * 2.0], rtol=1e-6)


def test_unknown_loss_is_refused():
    with pytest.raises(InvalidRequest):
        datum_loss("hinge", torch.zeros(3), {}, {})
