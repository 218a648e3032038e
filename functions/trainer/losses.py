"""Tinker's built-in losses as differentiable functions of one datum's learner logprobs.

Contract: `datum_loss(loss_fn, logprobs_S, inputs, config)` returns the SUM over the datum's
target positions of the per-token loss, a 0-d tensor whose gradient flows only through
`logprobs_S`. Tinker sums over tokens and datums (never averages), so the batch loss is the
plain sum of `datum_loss` over the batch, and any normalisation is the caller's business
(it lives in the advantages or weights).

The suffix `_S` means "shaped like target_tokens": [N] for one target per position, [N, K]
for K targets per position. Every input tensor of a datum has that shape (the gateway checks
it), so all the formulas below are elementwise followed by one sum.

Notation (Tinker's docs): lp = learner logprobs, q = `logprobs` input (the sampler's),
A = `advantages`, r = exp(lp - q), sg = stop-gradient.

- cross_entropy        sum(-lp * w), w = `weights` (ones when absent; any real, even negative)
- importance_sampling  sum(-r * A)
- ppo                  sum(-min(r * A, clip(r, lo, hi) * A))
- cispo                sum(-sg(clip(r, lo, hi)) * lp * A)
- dro                  sum(-(lp * A - beta/2 * (lp - q)^2))
- gspo                 GSPO-token: every token's ratio has the VALUE of the sequence ratio
                       s = exp(mean over M of (lp - q)) and the GRADIENT of its own lp,
                       then the PPO objective. M = positions where `sequence_ratio_mask`
                       is non-zero. Without a mask, M = positions with a non-zero advantage:
                       that is what marks the sampled tokens in a Tinker RL datum (prompt
                       positions carry A = 0 and a placeholder q = 0 that would wreck the
                       geometric mean), and a position with A = 0 adds nothing to the loss
                       anyway. An empty M gives s = 1.

- stable_reinforce     sum over M of (-sg(min(u, c)) * lp * A + kl * (u - 1 - log u)),
                       u = exp(lp - mu): truncated-importance-weighted REINFORCE against
                       the sampler's RECORDED logprob mu of the distribution each token was
                       drawn from (`stability_logprobs`, filled by the gateway from the
                       sample's stability record, not the client's `logprobs`), plus an
                       optional k3 estimate of KL(sampler || learner). M = rows a sampled
                       provenance span backs (`stability_mask`); c = `clip_high_threshold`
                       (2.0), kl = `kl_coeff` (0.0). On-policy (lp = mu) its gradient is
                       importance_sampling's, -A per token. docs/losses.md says what of
                       this is assumed (Tinker has not published the formula).

`lo`/`hi` are `clip_low_threshold`/`clip_high_threshold`: absolute bounds on the ratio (PPO's
0.8/1.2, not the epsilons). A per-token tensor of that name in the datum's inputs overrides
the config scalar position by position.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from openrl_core.errors import InvalidRequest
from openrl_core.stability import STABILITY_LOGPROBS, STABILITY_MASK

Inputs = Mapping[str, torch.Tensor]
Config = Mapping[str, float]


def datum_loss(loss_fn: str, logprobs_S: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    """The summed loss of one datum; `inputs` holds its loss_fn_inputs as tensors (no target_tokens needed)."""
    formula = _FORMULAS.get(loss_fn)
    if formula is None:
        raise InvalidRequest(f"unknown loss_fn {loss_fn!r}; supported: {sorted(_FORMULAS)}")
    return formula(logprobs_S, inputs, config)


def _cross_entropy(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    weights = inputs.get("weights")
    if weights is None:
        return -lp.sum()
    return -(lp * weights).sum()


def _importance_sampling(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    return -(ratio * inputs["advantages"]).sum()


def _ppo(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    return _clipped_objective_loss(ratio, inputs, config)


def _cispo(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    low, high = _thresholds(ratio, inputs, config)
    coefficient = torch.clamp(ratio, low, high).detach()
    return -(coefficient * lp * inputs["advantages"]).sum()


def _dro(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    quadratic = (lp - inputs["logprobs"]) ** 2
    objective = lp * inputs["advantages"] - 0.5 * config["beta"] * quadratic
    return -objective.sum()


def _gspo(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    advantages = inputs["advantages"]
    mask = inputs.get("sequence_ratio_mask")
    in_ratio = (mask != 0) if mask is not None else (advantages != 0)
    token_log_ratio = lp.detach() - inputs["logprobs"]
    if bool(in_ratio.any()):
        sequence_log_ratio = token_log_ratio[in_ratio].mean()
    else:
        sequence_log_ratio = torch.zeros((), dtype=lp.dtype, device=lp.device)
    # value exp(sequence_log_ratio), derivative w.r.t. each lp_t equal to that value
    ratio = torch.exp(sequence_log_ratio + lp - lp.detach())
    return _clipped_objective_loss(ratio, inputs, config)


def _stable_reinforce(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    mu, mask = inputs.get(STABILITY_LOGPROBS), inputs.get(STABILITY_MASK)
    if mu is None or mask is None:
        raise InvalidRequest("loss_fn 'stable_reinforce' reached the trainer without its stability records")
    in_m = mask != 0
    # Rows outside M hold a placeholder mu of 0; their log-ratio is forced to 0 so exp
    # cannot overflow there (and their terms are masked out anyway).
    log_ratio = torch.where(in_m, lp - mu, torch.zeros_like(lp))
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio.detach(), max=float(config["clip_high_threshold"]))
    policy = -weight * lp * inputs["advantages"]
    kl = float(config["kl_coeff"]) * (ratio - 1.0 - log_ratio)
    return torch.where(in_m, policy + kl, torch.zeros_like(lp)).sum()


def _clipped_objective_loss(ratio: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    advantages = inputs["advantages"]
    low, high = _thresholds(ratio, inputs, config)
    clipped = torch.clamp(ratio, low, high)
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    return -objective.sum()


def _thresholds(like: torch.Tensor, inputs: Inputs, config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token bounds: the datum's threshold tensors where given, else the config scalars."""
    bounds = []
    for name in ("clip_low_threshold", "clip_high_threshold"):
        per_token = inputs.get(name)
        if per_token is None:
            per_token = torch.full_like(like, float(config[name]))
        bounds.append(per_token.to(like.dtype))
    return bounds[0], bounds[1]


_FORMULAS: dict[str, Callable[[torch.Tensor, Inputs, Config], torch.Tensor]] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
    "gspo": _gspo,
    "stable_reinforce": _stable_reinforce,
}
