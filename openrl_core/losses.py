"""The catalogue of built-in losses: which inputs each needs and which config keys it takes.

The maths lives in the trainer (`functions/trainer/losses.py`); this module only knows the
contract, so the gateway can refuse a bad request before it reaches an accelerator.
Definitions follow Tinker's documentation: per-token losses, summed over tokens and datums.

`stable_reinforce` trains on per-sequence records the sampler keeps when asked with
`record_stability_info` (`openrl_core.stability`): a client sends importance_sampling's
inputs plus provenance spans, and the gateway adds `stability_logprobs` / `stability_mask`
from the records (a client may not send those two itself; `stability.resolve` refuses them).
One of Tinker's loss names is refused with a reason instead of "unknown" (`UNSUPPORTED`):
`custom`, the server-side traced loss this server does not advertise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from openrl_core.errors import InvalidRequest
from openrl_core.stability import STABILITY_INPUTS

RL_INPUTS = ("target_tokens", "logprobs", "advantages")
CLIP_INPUTS = ("clip_low_threshold", "clip_high_threshold")


@dataclass(frozen=True)
class LossSpec:
    name: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    config_defaults: Mapping[str, float] = field(default_factory=dict)


LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("cross_entropy", ("target_tokens",), ("weights",)),
        LossSpec("importance_sampling", RL_INPUTS),
        LossSpec("ppo", RL_INPUTS, CLIP_INPUTS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        LossSpec("cispo", RL_INPUTS, CLIP_INPUTS, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
        LossSpec("dro", RL_INPUTS, (), {"beta": 0.05}),
        LossSpec(
            "gspo",
            RL_INPUTS,
            ("sequence_ratio_mask", *CLIP_INPUTS),
            {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        ),
        # `logprobs` is accepted (the cookbook sends it) but unused: the loss reads the
        # sampler's own record instead. clip_high_threshold caps the importance weight.
        LossSpec(
            "stable_reinforce",
            ("target_tokens", "advantages"),
            ("logprobs", *STABILITY_INPUTS),
            {"clip_high_threshold": 2.0, "kl_coeff": 0.0},
        ),
    )
}


UNSUPPORTED: dict[str, str] = {
    "custom": "loss_fn 'custom' runs a traced loss stored with create_custom_loss, which this server does not offer "
    "(its /client/config says custom_loss_server_side=false); TrainingClient.forward_backward_custom computes "
    "custom losses client-side through forward logprobs and works",
}


def loss_spec(loss_fn: str) -> LossSpec:
    spec = LOSSES.get(loss_fn)
    if spec is None:
        if loss_fn in UNSUPPORTED:
            raise InvalidRequest(UNSUPPORTED[loss_fn])
        raise InvalidRequest(f"unknown loss_fn {loss_fn!r}; supported: {sorted(LOSSES)}")
    return spec


def resolve_config(loss_fn: str, config: Mapping[str, float | str] | None) -> dict[str, float]:
    """Defaults overlaid with the request's values; unknown or non-numeric keys are refused."""
    spec = loss_spec(loss_fn)
    resolved = dict(spec.config_defaults)
    for key, value in (config or {}).items():
        if key not in spec.config_defaults:
            allowed = sorted(spec.config_defaults) or "none"
            raise InvalidRequest(f"loss_fn_config key {key!r} is not used by {loss_fn!r}; allowed keys: {allowed}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidRequest(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
        resolved[key] = float(value)
    return resolved
