"""Forward (and backward) passes shared by several LoRA models on one base: each row its adapter.

`run(peft, requests, params, limits)` plans passes (`openrl_core.packing`), and for
each pass right-pads its rows to the pass's bucket, runs the shared decoder once with PEFT's
per-row adapters (`adapter_names`: every LoRA layer applies each adapter to its own rows
only), then, unit by unit, projects the unit's positions through lm_head with the unit's
own adapter, computes its datums' Tinker losses and sums the units' losses into one
backward (the sum's gradient is 1 for every unit, so each unit gets exactly its own).

Why this is bitwise what a model computes alone: alone is this same code with one request,
and nothing a row computes depends on its neighbours: its padded length is its bucket, every
product has at least 16 rows, a unit's adapter products and lm_head chunks cover exactly that
unit, and a model's units run in the same order. Requests are checked before anything runs,
so a bad one fails alone; if a pass fails anyway, its requests run again one by one so only
the failing one reports the error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from functions.trainer import batching, passes
from functions.trainer.passes import ForwardBackwardResult
from openrl_core import packing
from openrl_core.datum import Datum


@dataclass
class Request:
    adapter: str  # the PEFT adapter name of the model
    batch: list[Datum]
    loss_fn: str
    config: dict[str, float]
    forward_only: bool


def run(peft, requests: list[Request], params: dict[str, dict], limits: packing.Limits, device) -> list:
    """Per request a ForwardBackwardResult, or the exception that request alone raised.

    `params`: adapter name -> its parameters, to put gradients back as they were when a
    shared pass fails halfway (then every request runs again on its own)."""
    saved = {name: {k: (p.grad.clone() if p.grad is not None else None) for k, p in params[name].items()}
             for name in {r.adapter for r in requests if not r.forward_only}} if len(requests) > 1 else {}  # fmt: skip
    try:
        return _run(peft, requests, limits, device)
    except Exception:
        if len(requests) == 1:
            raise
        for name, grads in saved.items():
            for key, grad in grads.items():
                params[name][key].grad = grad
        return [_alone(peft, r, params, limits, device) for r in requests]


def _run(peft, requests: list[Request], limits: packing.Limits, device) -> list[ForwardBackwardResult]:
    plan = packing.plan(
        [[int(d.tokens_N.size) for d in r.batch] for r in requests], limits.max_tokens, limits.max_rows,
        [r.adapter for r in requests], limits.max_shared_tokens,
    )
    logprobs: list[list[Optional[np.ndarray]]] = [[None] * len(r.batch) for r in requests]
    losses = [0.0] * len(requests)
    _set_trainable(peft, {r.adapter for r in requests if not r.forward_only})
    for units in plan:
        _run_pass(peft, units, requests, logprobs, losses, device)
    return [ForwardBackwardResult(logprobs=logprobs[i], metrics={"loss:sum": losses[i]}) for i in range(len(requests))]


def _alone(peft, request: Request, params, limits: packing.Limits, device):
    try:
        return run(peft, [request], params, limits, device)[0]
    except Exception as exc:  # this request's own failure
        return exc


def _set_trainable(peft, names: set[str]) -> None:
    """Only the training requests' adapters record gradients."""
    for module in peft.modules():
        lora_a = getattr(module, "lora_A", None)
        if isinstance(lora_a, torch.nn.ModuleDict):
            for name in lora_a:
                wanted = name in names
                for param in (*lora_a[name].parameters(), *module.lora_B[name].parameters()):
                    param.requires_grad_(wanted)


def _run_pass(peft, units: list[packing.Unit], requests: list[Request], logprobs, losses, device) -> None:
    size = units[0].bucket
    rows = [(unit, requests[unit.request].batch[i]) for unit in units for i in unit.datums]
    tokens_B_T = torch.full((len(rows), size), batching.PAD_TOKEN, dtype=torch.long)
    mask_B_T = torch.zeros((len(rows), size), dtype=torch.long)
    for row, (_unit, datum) in enumerate(rows):
        n = int(datum.tokens_N.size)
        tokens_B_T[row, :n] = torch.from_numpy(np.asarray(datum.tokens_N, dtype=np.int64))
        mask_B_T[row, :n] = 1
    names = [requests[unit.request].adapter for unit, _datum in rows]
    train = any(not requests[u.request].forward_only for u in units)
    decoder, lm_head = peft.get_decoder(), peft.get_output_embeddings()
    with torch.set_grad_enabled(train):
        with peft.base_model._enable_peft_forward_hooks(adapter_names=names):
            hidden_B_T_H = decoder(
                input_ids=tokens_B_T.to(device), attention_mask=mask_B_T.to(device), use_cache=False
            ).last_hidden_state
        total, start = None, 0
        for unit in units:
            request = requests[unit.request]
            micro = [request.batch[i] for i in unit.datums]
            hidden = hidden_B_T_H[start : start + len(micro)]
            start += len(micro)
            logprobs_D = batching.logprobs_from_hidden(lm_head, hidden, micro, request.adapter)
            loss = passes.batch_loss(request.loss_fn, request.config, micro, logprobs_D, device)
            losses[unit.request] += float(loss.detach())
            for index, logprobs_S in zip(unit.datums, logprobs_D):
                logprobs[unit.request][index] = logprobs_S.detach().cpu().numpy().astype(np.float32, copy=False)
            if not request.forward_only:
                total = loss if total is None else total + loss
        if total is not None and total.requires_grad:
            total.backward()
