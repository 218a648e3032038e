"""`stable_reinforce` against an independent float64 reference written here, value and gradient.

The reference walks the tokens one by one with Python floats: on a row a sampled span backs
(mask 1), with u = exp(lp - mu),

    loss_t = -min(u, c) * A * lp + kl * (u - 1 - (lp - mu)),
    d loss_t / d lp = -min(u, c) * A + kl * (u - 1)    (the weight is a stop-gradient),

and 0 elsewhere. The inputs put ratios below 1, between 1 and the cap and above it, with
advantages of both signs, and give masked-out rows a placeholder mu of 0 (as the gateway
does) under large learner logprobs, where an unmasked exp would overflow.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from functions.trainer.losses import datum_loss
from openrl_core.errors import InvalidRequest
from openrl_core.losses import resolve_config
from openrl_core.stability import STABILITY_LOGPROBS, STABILITY_MASK


def reference(lp, mu, mask, adv, cap, kl):
    value, grad = 0.0, []
    for lp_t, mu_t, m_t, a_t in zip(lp, mu, mask, adv):
        if m_t == 0:
            grad.append(0.0)
            continue
        u = math.exp(lp_t - mu_t)
        w = min(u, cap)
        value += -w * a_t * lp_t + kl * (u - 1.0 - (lp_t - mu_t))
        grad.append(-w * a_t + kl * (u - 1.0))
    return value, np.asarray(grad)


def inputs_for(n: int, seed: int):
    rng = np.random.default_rng(seed)
    mask = (np.arange(n) >= n // 3).astype(np.float32)  # prompt rows first, then sampled ones
    lp = rng.uniform(-4.0, -0.05, n)
    # log-ratios spread over [-1.5, 1.5]: u from 0.22 to 4.5, on both sides of the cap 2
    mu = np.where(mask == 1, lp - rng.uniform(-1.5, 1.5, n), 0.0).astype(np.float32)
    adv = np.where(mask == 1, rng.choice([-1.0, -0.25, 0.5, 1.5], n), 0.0).astype(np.float32)
    lp[mask == 0] = 80.0  # exp(80) overflows float32: must never be taken on a masked-out row
    return lp, mu, mask, adv


@pytest.mark.parametrize("config", [None, {"kl_coeff": 0.3}, {"clip_high_threshold": 1.2, "kl_coeff": 0.05}])
@pytest.mark.parametrize("seed", [0, 1])
def test_value_and_gradient_match_the_reference(config, seed):
    lp, mu, mask, adv = inputs_for(24, seed)
    resolved = resolve_config("stable_reinforce", config)
    lp_t = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
    inputs = {
        "advantages": torch.tensor(adv),
        "logprobs": torch.zeros(24),  # the client's copy: never read
        STABILITY_LOGPROBS: torch.tensor(mu),
        STABILITY_MASK: torch.tensor(mask),
    }
    loss = datum_loss("stable_reinforce", lp_t, inputs, resolved)
    loss.backward()
    lp32 = lp.astype(np.float32).astype(np.float64)  # the values the trainer saw
    value, grad = reference(lp32, mu.astype(np.float64), mask, adv.astype(np.float64), *resolved.values())
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(value, rel=1e-5, abs=1e-4)
    np.testing.assert_allclose(lp_t.grad.numpy(), grad, rtol=1e-5, atol=1e-5)
    ratios = np.exp(lp32 - mu)[mask == 1]
    assert (ratios > resolved["clip_high_threshold"]).any() and (ratios < 1).any()  # the cap binds somewhere


def test_on_policy_its_gradient_is_importance_samplings():
    lp, _mu, mask, adv = inputs_for(16, 2)
    lp = np.where(mask == 1, lp, -1.0).astype(np.float32)
    grads = []
    for loss_fn, inputs in (
        ("stable_reinforce", {STABILITY_LOGPROBS: torch.tensor(lp * mask), STABILITY_MASK: torch.tensor(mask)}),
        ("importance_sampling", {"logprobs": torch.tensor(lp)}),
    ):
        lp_t = torch.tensor(lp, requires_grad=True)
        datum_loss(loss_fn, lp_t, {"advantages": torch.tensor(adv), **inputs}, resolve_config(loss_fn, None)).backward()
        grads.append(lp_t.grad.numpy())
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grads[0], -adv, rtol=1e-6, atol=1e-7)


def test_without_its_records_the_trainer_refuses():
    lp_t = torch.zeros(3, requires_grad=True)
    with pytest.raises(InvalidRequest, match="without its stability records"):
        datum_loss("stable_reinforce", lp_t, {"advantages": torch.ones(3)}, resolve_config("stable_reinforce", None))
