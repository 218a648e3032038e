"""AdamW over one adapter's LoRA parameters, with every hyperparameter supplied per step.

Tinker's `optim_step` carries a full `AdamParams` on every call (a client may schedule the
learning rate, betas, eps, weight decay or clip norm from step to step), so the optimizer
keeps only the per-parameter state: the step count and the two moment buffers. The update is
torch's AdamW, written out so that its state is plain named tensors that export to
safetensors without pickle:

    g   <- g * min(1, clip / (||g|| + 1e-6))    only when grad_clip_norm > 0 (torch's rule)
    p   <- p * (1 - lr * weight_decay)          decoupled weight decay
    m   <- beta1 * m + (1 - beta1) * g          as m.lerp_(g, 1 - beta1)
    v   <- beta2 * v + (1 - beta2) * g^2
    p   <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Each line is the tensor operation `torch.optim.AdamW` (single-tensor path, the CPU default)
performs, in its order, so a step is bitwise torch's given the same gradients: full
fine-tuning is tested that way against a plain torch loop.

||g|| is the global L2 norm over all of the parameters' gradients; the step reports it
BEFORE clipping. A parameter without a gradient (nothing reached it since the last step)
steps with a zero gradient, so all of a model's parameters share one step count.

The second family, Dimuon (`dimuon.py`), keeps the same kind of state (a step count, one
momentum buffer); the functions at the end (`fresh_state`, `step`, `clone_state`,
`training_slots`, `state_to_files`, `state_from_files`) take either state and dispatch on
it, so engines, parking, snapshots and checkpoints handle both families alike. A step of
the other family than the model's is a user error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from functions.trainer import dimuon, tensor_files
from functions.trainer.dimuon import DimuonState
from functions.trainer.grad_norm import CLIP_EPSILON, global_grad_norm
from openrl_core.errors import InvalidRequest
from openrl_core.params import ADAMW, DIMUON, AdamParams, DimuonParams

STATE_TENSORS = "optimizer.safetensors"
STATE_META = "optimizer.json"
STATE_FORMAT = "openrl.adamw.v1"


# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing; kept for parity.
@dataclass
class AdamState:
    """Moments keyed like the adapter's parameters (PEFT key names)."""

    step: int = 0
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)


def training_slots(params: Mapping[str, torch.nn.Parameter], state: "AdamState | DimuonState") -> list:
    """Where a model's training state lives (weights, gradients, moments), for parking."""
    from functions.compute import parking

    if isinstance(state, DimuonState):
        return parking.param_slots("w/", dict(params)) + parking.dict_slots("m/", state.momentum)
    return (
        parking.param_slots("w/", dict(params))
        + parking.dict_slots("m/", state.exp_avg)
        + parking.dict_slots("v/", state.exp_avg_sq)
    )


def fresh_state(params: Mapping[str, torch.nn.Parameter], family: str = ADAMW) -> "AdamState | DimuonState":
    """Zeroed state of the optimizer family `family` ("adamw" or "dimuon")."""
    if family == DIMUON:
        return dimuon.fresh_state(params)
    return AdamState(
        step=0,
        exp_avg={name: torch.zeros_like(p, memory_format=torch.contiguous_format) for name, p in params.items()},
        exp_avg_sq={name: torch.zeros_like(p, memory_format=torch.contiguous_format) for name, p in params.items()},
    )


@torch.no_grad()
def adamw_step(
    params: Mapping[str, torch.nn.Parameter], state: AdamState, hp: AdamParams, grad_norm_of=global_grad_norm
) -> float:
    """Apply one AdamW update in place from the parameters' `.grad`; return the pre-clip grad norm.

    Each line of the update runs over all of the parameters at once (`torch._foreach_*`): a
    LoRA adapter is hundreds of small tensors, and one Python call per tensor and operation
    cost more than the arithmetic (SmolLM2, r8: 422 tensors). On CPU those ops apply the same
    per-tensor kernel to each tensor in turn, so the result is bitwise the single-tensor path's
    (tested against `torch.optim.AdamW(foreach=False)`). `grad_norm_of(grads)`: the global
    norm, for callers whose tensors are shards of a larger model (fsdp.py all-reduces it)."""
    names = list(params)  # the caller's order: the norm's sum runs in it, as clip_grad_norm_'s does
    weights = [params[name] for name in names]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in weights]
    grad_norm = grad_norm_of(grads)
    if hp.grad_clip_norm > 0:
        coefficient = torch.clamp(hp.grad_clip_norm / (grad_norm + CLIP_EPSILON), max=1.0)
        grads = torch._foreach_mul(grads, coefficient)

    state.step += 1
    bias_correction1 = 1.0 - hp.beta1**state.step
    bias_correction2_sqrt = (1.0 - hp.beta2**state.step) ** 0.5  # torch's expression, not math.sqrt
    step_size = hp.learning_rate / bias_correction1
    exp_avg = [state.exp_avg[name] for name in names]
    exp_avg_sq = [state.exp_avg_sq[name] for name in names]
    torch._foreach_mul_(weights, 1.0 - hp.learning_rate * hp.weight_decay)
    torch._foreach_lerp_(exp_avg, grads, 1.0 - hp.beta1)
    torch._foreach_mul_(exp_avg_sq, hp.beta2)
    torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1.0 - hp.beta2)
    denominators = torch._foreach_sqrt(exp_avg_sq)
    torch._foreach_div_(denominators, bias_correction2_sqrt)
    torch._foreach_add_(denominators, hp.eps)
    torch._foreach_addcdiv_(weights, exp_avg, denominators, value=-step_size)
    return float(grad_norm)


def family_of(state: "AdamState | DimuonState") -> str:
    return DIMUON if isinstance(state, DimuonState) else ADAMW


def step(
    params: Mapping[str, torch.nn.Parameter], state: "AdamState | DimuonState", hp: "AdamParams | DimuonParams"
) -> float:
    """One step of the state's family; hyperparameters of the other family are refused."""
    if isinstance(state, DimuonState) and isinstance(hp, DimuonParams):
        return dimuon.dimuon_step(params, state, hp)
    if isinstance(state, AdamState) and isinstance(hp, AdamParams):
        return adamw_step(params, state, hp)
    wanted = "DimuonParams" if isinstance(state, DimuonState) else "AdamParams"
    raise InvalidRequest(
        f"this model trains with the {family_of(state)} optimizer chosen at its creation; optim_step needs {wanted}"
    )


def clone_state(state: "AdamState | DimuonState", device=None) -> "AdamState | DimuonState":
    """A copy of the state (on `device`, default where it is), for snapshots and exports."""
    if isinstance(state, DimuonState):
        return dimuon.clone(state, device)
    return AdamState(
        step=state.step,
        exp_avg={k: t.to(device or t.device, copy=True) for k, t in state.exp_avg.items()},
        exp_avg_sq={k: t.to(device or t.device, copy=True) for k, t in state.exp_avg_sq.items()},
    )


def state_to_files(state: "AdamState | DimuonState") -> dict[str, bytes]:
    if isinstance(state, DimuonState):
        meta = {"format": dimuon.STATE_FORMAT, "step": state.step}
        return {
            STATE_TENSORS: tensor_files.save(dimuon.state_tensors(state)),
            STATE_META: json.dumps(meta, sort_keys=True).encode(),
        }
    tensors = {}
    for name in sorted(state.exp_avg):
        tensors[f"exp_avg/{name}"] = state.exp_avg[name].detach().cpu().contiguous()
        tensors[f"exp_avg_sq/{name}"] = state.exp_avg_sq[name].detach().cpu().contiguous()
    meta = {"format": STATE_FORMAT, "step": state.step}
    return {
        STATE_TENSORS: tensor_files.save(tensors),
        STATE_META: json.dumps(meta, sort_keys=True).encode(),
    }


def state_from_files(files: Mapping[str, bytes], params: Mapping[str, torch.nn.Parameter]) -> "AdamState | DimuonState":
    """Rebuild the state for `params`, of the family the files hold; they must hold its
    buffers for exactly those names."""
    if STATE_TENSORS not in files or STATE_META not in files:
        raise InvalidRequest("the checkpoint holds no optimizer state; load it without the optimizer")
    try:
        meta = json.loads(files[STATE_META])
        tensors = load_safetensors(files[STATE_TENSORS])
    except (ValueError, RuntimeError, SafetensorError) as error:
        raise InvalidRequest(f"the checkpoint's optimizer state is unreadable: {error}") from error
    formats = (STATE_FORMAT, dimuon.STATE_FORMAT)
    if not isinstance(meta, dict) or meta.get("format") not in formats or not isinstance(meta.get("step"), int):
        raise InvalidRequest(f"the checkpoint's optimizer state is in none of the formats {', '.join(formats)}")
    if meta["format"] == dimuon.STATE_FORMAT:
        return dimuon.state_from_tensors(int(meta["step"]), tensors, params)
    expected = {f"{kind}/{name}" for name in params for kind in ("exp_avg", "exp_avg_sq")}
    if set(tensors) != expected:
        raise InvalidRequest("the checkpoint's optimizer state does not match the adapter's parameters")
    state = AdamState(step=int(meta["step"]))
    for name, p in params.items():
        for kind, buffers in (("exp_avg", state.exp_avg), ("exp_avg_sq", state.exp_avg_sq)):
            tensor = tensors[f"{kind}/{name}"]
            if tensor.shape != p.shape:
                shape, expected = list(tensor.shape), list(p.shape)
                raise InvalidRequest(f"optimizer state {kind}/{name} has shape {shape}, expected {expected}")
            buffers[name] = tensor.to(device=p.device, dtype=p.dtype).contiguous()
    return state
