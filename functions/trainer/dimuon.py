"""Dimuon over one adapter's LoRA matrices: momentum, orthogonalised by Newton-Schulz, stepped
at a fixed Frobenius norm. The second optimizer family of SDK 0.38 (`DimuonOptimizerConfig`
at model creation, `DimuonParams` on every step).

What is published, and so what this implements. SDK 0.38 gives the step three fields:
`learning_rate` ("sets the step size"), `grad_clip_norm` ("nonpositive values disable
clipping") and `beta1` ("EMA coefficient for the momentum"). Tinker's public API reference
(for a later SDK) adds that the learning rate is "applied to a direction with Frobenius norm
sqrt(rank)" and that the "matrix-sign iteration count and normalization epsilon are
internal constants": the direction is the matrix sign (the orthogonal polar factor) of the
momentum, as in Muon (Jordan et al., 2024), computed by a Newton-Schulz iteration. The
hosted service's exact constants are not published, nor are the row and column
preconditioner and its `damping` and the rank correction that later SDKs expose (0.38 has
neither field). So, for every LoRA matrix p (2-D: A is [r, in], B is [out, r]):

    g   <- g * min(1, clip / (||g|| + 1e-6))     only when grad_clip_norm > 0 (AdamW's rule)
    m   <- beta1 * m + (1 - beta1) * g            as m.lerp_(g, 1 - beta1)
    X   <- msign(m)                               5 quintic Newton-Schulz steps (below)
    d   <- X * sqrt(k) / ||X||_F                  k = min(rows, cols): the LoRA rank r
    p   <- p - lr * d                             (d = 0 where m = 0)

msign is Keller Jordan's iteration, in float32: X0 = m / (||m||_F + 1e-7), on the wide
orientation (transposed when rows > cols), then X <- a X + (b A + c A A) X with A = X X^T
and (a, b, c) = (3.4445, -4.7750, 2.0315). Its singular values land near 1 but not on it,
so d is renormalised to norm sqrt(k) exactly: every matrix steps by lr * sqrt(rank) in
Frobenius norm whatever its gradient's scale. ||g|| is the global norm over all of the
adapter's gradients, reported before clipping, as AdamW reports it. There is no weight
decay (0.38's DimuonParams has none). Numbers will not match the hosted service's Dimuon;
the contract is this docstring, tested against a plain re-computation.

State is plain named tensors like AdamW's (`optimizer.py`): a step count and one momentum
buffer per parameter, keyed by PEFT names, exported as `momentum/<name>` in
`optimizer.safetensors` with format `openrl.dimuon.v1` in `optimizer.json`, so parking,
snapshots, forks and save_state treat both families alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from functions.trainer.grad_norm import CLIP_EPSILON, global_grad_norm
from openrl_core.errors import InvalidRequest
from openrl_core.params import DimuonParams

STATE_FORMAT = "openrl.dimuon.v1"
NS_STEPS = 5
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPSILON = 1e-7


@dataclass
class DimuonState:
    """Momentum keyed like the adapter's parameters (PEFT key names)."""

    step: int = 0
    momentum: dict[str, torch.Tensor] = field(default_factory=dict)


def fresh_state(params: Mapping[str, torch.nn.Parameter]) -> DimuonState:
    for name, p in params.items():
        if p.dim() != 2:
            raise InvalidRequest(f"Dimuon steps matrices; parameter {name} has shape {list(p.shape)}")
    return DimuonState(
        step=0,
        momentum={name: torch.zeros_like(p, memory_format=torch.contiguous_format) for name, p in params.items()},
    )


def clone(state: DimuonState, device: str | torch.device | None = None) -> DimuonState:
    return DimuonState(state.step, {k: t.to(device or t.device, copy=True) for k, t in state.momentum.items()})


def msign(m_R_C: torch.Tensor) -> torch.Tensor:
    """Newton-Schulz approximation of the orthogonal polar factor of a matrix (float32)."""
    a, b, c = NS_COEFFICIENTS
    x = m_R_C.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + NS_EPSILON)
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if tall else x


def direction(m_R_C: torch.Tensor) -> torch.Tensor:
    """msign(m) rescaled to Frobenius norm sqrt(min(R, C)); zero where m is zero."""
    x = msign(m_R_C)
    norm = torch.linalg.matrix_norm(x)
    if not bool(norm > 0):
        return torch.zeros_like(m_R_C)
    return (x * (math.sqrt(min(m_R_C.shape)) / norm)).to(m_R_C.dtype)


@torch.no_grad()
def dimuon_step(params: Mapping[str, torch.nn.Parameter], state: DimuonState, hp: DimuonParams) -> float:
    """Apply one Dimuon update in place from the parameters' `.grad`; return the pre-clip norm."""
    names = list(params)
    grads = [params[n].grad if params[n].grad is not None else torch.zeros_like(params[n]) for n in names]
    grad_norm = global_grad_norm(grads)
    if hp.grad_clip_norm > 0:
        coefficient = torch.clamp(hp.grad_clip_norm / (grad_norm + CLIP_EPSILON), max=1.0)
        grads = [g * coefficient for g in grads]
    state.step += 1
    for name, grad in zip(names, grads):
        momentum = state.momentum[name]
        momentum.lerp_(grad, 1.0 - hp.beta1)
        params[name].sub_(direction(momentum), alpha=hp.learning_rate)
    return float(grad_norm)


def state_tensors(state: DimuonState) -> dict[str, torch.Tensor]:
    return {f"momentum/{name}": state.momentum[name].detach().cpu().contiguous() for name in sorted(state.momentum)}


def state_from_tensors(
    step: int, tensors: Mapping[str, torch.Tensor], params: Mapping[str, torch.nn.Parameter]
) -> DimuonState:
    if set(tensors) != {f"momentum/{name}" for name in params}:
        raise InvalidRequest("the checkpoint's optimizer state does not match the adapter's parameters")
    state = DimuonState(step=step)
    for name, p in params.items():
        tensor = tensors[f"momentum/{name}"]
        if tensor.shape != p.shape:
            shape, expected = list(tensor.shape), list(p.shape)
            raise InvalidRequest(f"optimizer state momentum/{name} has shape {shape}, expected {expected}")
        state.momentum[name] = tensor.to(device=p.device, dtype=p.dtype).contiguous()
    return state
