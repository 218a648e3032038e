"""Forward (and backward) passes shared by several LoRA models on one base: each row its adapter.

`run(peft, requests, params, limits)` plans passes (`openrl_core.packing`), and for each pass
right-pads its rows to the pass's bucket, runs the shared decoder once with every LoRA layer
applying each unit's adapter to that unit's rows only (`_unit_adapters`, one `_LayerLora` node
a layer), projects the pass's positions through lm_head (in chunks the units share when lm_head
has no LoRA, else a unit's own, `_unit_logprobs`), computes each unit's Tinker losses and sums them into one backward
(the sum's gradient is 1 for every unit, so each unit gets exactly its own).

Why this is bitwise what a model computes alone: alone is this same code with one request,
and nothing a row computes depends on its neighbours: its padded length is its bucket, every
product of the base weights has at least 16 rows, a unit's adapter products cover exactly
its rows, and a model's units run in the same order. Requests are checked before anything runs,
so a bad one fails alone; if a pass fails anyway, its requests run again one by one so only
the failing one reports the error.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

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
        [[int(d.tokens_N.size) for d in r.batch] for r in requests],
        limits.max_tokens,
        limits.max_rows,
        [r.adapter for r in requests],
        limits.max_shared_tokens,
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
    train = any(not requests[u.request].forward_only for u in units)
    decoder, lm_head = peft.get_decoder(), peft.get_output_embeddings()
    adapters = [requests[u.request].adapter for u in units]
    # The units' adapters stay applied through the backward: with activation checkpointing
    # (precision.py) the decoder layers recompute there and must see the same adapters.
    with torch.set_grad_enabled(train), _unit_adapters(decoder, [len(unit.datums) for unit in units], adapters):
        hidden_B_T_H = decoder(
            input_ids=tokens_B_T.to(device), attention_mask=mask_B_T.to(device), use_cache=False
        ).last_hidden_state
        micros = [[requests[unit.request].batch[i] for i in unit.datums] for unit in units]
        per_unit = _unit_logprobs(lm_head, hidden_B_T_H, units, micros, adapters)
        total = None
        for unit, micro, logprobs_D in zip(units, micros, per_unit):
            request = requests[unit.request]
            loss = passes.batch_loss(request.loss_fn, request.config, micro, logprobs_D, device)
            losses[unit.request] += float(loss.detach())
            for index, logprobs_S in zip(unit.datums, logprobs_D):
                logprobs[unit.request][index] = logprobs_S.detach().cpu().numpy().astype(np.float32, copy=False)
            if not request.forward_only:
                total = loss if total is None else total + loss
        if total is not None and total.requires_grad:
            total.backward()


@contextmanager
def _unit_adapters(decoder, sizes: list[int], names: list[str]):
    """Every LoRA linear layer of the decoder applies, to each unit's rows (consecutive, `sizes`
    of them), that unit's adapter (`names`) only.

    Why not PEFT's own mixed-adapter batch (`adapter_names`): it gathers and scatters each
    adapter's rows by index, and the backward of every gather fills a zero tensor the size of
    the whole input, per adapter and layer: with eight adapters that ate the gain of sharing
    the pass. Units are contiguous here, so each unit's LoRA product is added into its own row
    range of the base output in place (`_LayerLora`), with no fills, splits or concatenations;
    each unit's LoRA product covers exactly its rows, as alone.
    """
    layers = [m for m in decoder.modules() if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)]

    bounds = np.cumsum([0, *sizes]).tolist()
    spans = list(zip(bounds[:-1], bounds[1:], names))

    def forward(layer, x, *args, **kwargs):
        result = layer.base_layer(x, *args, **kwargs)
        units = [(first, last, layer.scaling[name], layer.lora_A[name].weight, layer.lora_B[name].weight)
                 for first, last, name in spans if name in layer.lora_A]  # fmt: skip
        if not units:
            return result
        # The adapter computes in its own dtype (float32); with a bf16 base the layer's input is
        # cast per use, not kept as a float32 copy (openrl_core/memory.py counts what is kept).
        weights = [w for *_rows, A_R_I, B_O_R in units for w in (A_R_I, B_O_R)]
        return _LayerLora.apply(x, result.to(units[0][3].dtype), tuple(u[:3] for u in units), *weights).to(result.dtype)

    for layer in layers:
        layer.forward = functools.partial(forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # back to the class's own forward


class _LayerLora(torch.autograd.Function):
    """Every unit's LoRA product on its own rows of one layer, `(x · Aᵀ · scaling) · Bᵀ`, added
    in place into the base layer's output, with the backward written out.

    The products autograd would form, in one graph node per layer instead of about a dozen per
    unit (two linears, a scale, views, transposes, and the split and concatenation that kept
    each unit on its rows): a pass runs this for every targeted layer, each unit on a few
    dozen rows, where the framework's per-op cost and the concatenation's copy of the whole
    output outweighed the arithmetic. The base output's gradient passes through unchanged.
    Alone and packed both run it, and each unit's products cover exactly its rows, so a
    unit's bits are the same either way. Rows of units whose adapter skips the layer keep the
    base output (and get no gradient from here).
    """

    @staticmethod
    def forward(ctx, x, base, units, *weights):
        x_N_I, out_N_O = x.reshape(-1, x.shape[-1]), base.view(-1, base.shape[-1])
        per_row = x_N_I.shape[0] // x.shape[0]  # positions per sequence
        scaled = []
        for (first, last, scaling), A_R_I, B_O_R in zip(units, weights[0::2], weights[1::2]):
            rows = slice(first * per_row, last * per_row)
            scaled_S_R = (x_N_I[rows].to(A_R_I.dtype) @ A_R_I.t()) * scaling  # scaled at rank width, not output width
            out_N_O[rows].addmm_(scaled_S_R, B_O_R.t())
            scaled.append(scaled_S_R)
        ctx.mark_dirty(base)
        ctx.save_for_backward(x_N_I, *weights, *scaled)
        ctx.units, ctx.per_row, ctx.shape = units, per_row, x.shape
        return base

    @staticmethod
    def backward(ctx, g_base):
        x_N_I, *saved = ctx.saved_tensors
        weights, scaled = saved[: 2 * len(ctx.units)], saved[2 * len(ctx.units) :]
        need_x = ctx.needs_input_grad[0]
        g_N_O = g_base.reshape(-1, g_base.shape[-1])
        dtype = weights[0].dtype
        g_x_N_I = x_N_I.new_zeros(x_N_I.shape, dtype=dtype) if need_x else None
        grads = []
        for index, (first, last, scaling) in enumerate(ctx.units):
            A_R_I, B_O_R, scaled_S_R = weights[2 * index], weights[2 * index + 1], scaled[index]
            need_A, need_B = ctx.needs_input_grad[3 + 2 * index], ctx.needs_input_grad[4 + 2 * index]
            rows = slice(first * ctx.per_row, last * ctx.per_row)
            g_S_O = g_N_O[rows]
            g_A = g_B = None
            if need_B:
                g_B = g_S_O.t() @ scaled_S_R
            if need_x or need_A:
                g_down_S_R = (g_S_O @ B_O_R) * scaling
                if need_A:
                    g_A = g_down_S_R.t() @ x_N_I[rows].to(dtype)
                if need_x:
                    torch.mm(g_down_S_R, A_R_I, out=g_x_N_I[rows])
            grads += [g_A, g_B]
        g_x = g_x_N_I.view(ctx.shape).to(x_N_I.dtype) if need_x else None
        return g_x, g_base, None, *grads


def _unit_logprobs(lm_head, hidden_B_T_H: torch.Tensor, units, micros, adapters: list[str]) -> list[list[torch.Tensor]]:
    """Per unit, its datums' target logprobs, with lm_head shared by the units of a pass.

    The vocabulary projection is a large share of a small pass, so units share its products:
    each unit's positions (real tokens only, concatenated) form a *segment*, padded with zero
    rows to at least `packing.PAD_MULTIPLE` rows (below that the CPU kernels take a path whose
    bits depend on the row count). Without LoRA on lm_head, segments that fit one logits
    chunk are stacked into shared chunks, where the projection runs once over every row; with
    it, each segment is projected as a chunk of its own, its LoRA added into all of it (below),
    which is exactly what the unit computes alone. A segment longer than a chunk is chunked on
    its own, as it is alone.
    """
    rows_per_chunk = max(packing.PAD_MULTIPLE, batching.LOGITS_CHUNK_ELEMENTS // lm_head.weight.shape[0])
    device = hidden_B_T_H.device
    segments = []  # (unit index, hidden_P_H padded, targets_P_K padded, real positions, widths)
    start = 0
    for index, micro in enumerate(micros):
        lengths = [int(d.tokens_N.size) for d in micro]
        hidden_P_H = torch.cat([hidden_B_T_H[start + row, :n] for row, n in enumerate(lengths)])
        start += len(micro)
        targets_P_K, widths = batching._stack_targets(micro, device)
        real = hidden_P_H.shape[0]
        if real < packing.PAD_MULTIPLE:
            pad = packing.PAD_MULTIPLE - real
            hidden_P_H = torch.cat([hidden_P_H, hidden_P_H.new_zeros(pad, hidden_P_H.shape[1])])
            targets_P_K = torch.cat(
                [targets_P_K, targets_P_K.new_full((pad, targets_P_K.shape[1]), batching.PAD_TOKEN)]
            )
        segments.append((index, hidden_P_H, targets_P_K, real, widths))
    outputs: list[torch.Tensor | None] = [None] * len(micros)
    shared: list = []
    # Kept or recomputed for the whole pass (`batching.recomputes_logits`): either way the
    # numbers are the same, so a unit's bits do not depend on what it was packed with.
    recompute = batching.recomputes_logits(sum(seg[1].shape[0] for seg in segments), lm_head.weight.shape[0])
    # With LoRA on lm_head every segment is a chunk of its own, computed exactly as alone: adding
    # a unit's LoRA into its rows of a shared chunk is an in-place op on a view, and autograd's
    # backward of that copies the whole [C, V] gradient once per unit (SmolLM2, 8 units of 2 x 32
    # tokens: eight 63 MB copies, 0.13 s of a 2.0 s pass), more than sharing the product saves.
    own_chunks = getattr(lm_head, "lora_A", None) is not None

    def flush():
        if not shared:
            return
        hidden_C_H = torch.cat([seg[1] for seg in shared])
        targets_C_K = torch.cat([seg[2] for seg in shared])
        spans, offset = [], 0
        for index, hidden_P_H, _t, real, _w in shared:
            spans.append((offset, offset + real, adapters[index]))
            offset += hidden_P_H.shape[0]
        if recompute:
            logprobs_C_K = checkpoint(
                _shared_chunk, lm_head, hidden_C_H, targets_C_K, tuple(spans), use_reentrant=False
            )
        else:
            logprobs_C_K = _shared_chunk(lm_head, hidden_C_H, targets_C_K, tuple(spans))
        offset = 0
        for index, hidden_P_H, _t, real, _w in shared:
            outputs[index] = logprobs_C_K[offset : offset + real]
            offset += hidden_P_H.shape[0]
        shared.clear()

    for segment in segments:
        index, hidden_P_H, targets_P_K, real, _widths = segment
        if hidden_P_H.shape[0] > rows_per_chunk:  # chunked on its own, exactly as alone
            pieces = []
            for first in range(0, real, rows_per_chunk):
                span = ((0, min(rows_per_chunk, real - first), adapters[index]),)
                args = (
                    lm_head,
                    hidden_P_H[first : first + rows_per_chunk],
                    targets_P_K[first : first + rows_per_chunk],
                    span,
                )
                pieces.append(
                    checkpoint(_shared_chunk, *args, use_reentrant=False) if recompute else _shared_chunk(*args)
                )
            outputs[index] = torch.cat(pieces)
            continue
        if shared and (own_chunks or sum(seg[1].shape[0] for seg in shared) + hidden_P_H.shape[0] > rows_per_chunk):
            flush()
        shared.append(segment)
    flush()
    out = []
    for (index, _h, _t, _real, widths), micro in zip(segments, micros):
        logprobs_P_K, per_datum, offset = outputs[index], [], 0
        for datum, width in zip(micro, widths):
            n = int(datum.tokens_N.size)
            per_datum.append(
                logprobs_P_K[offset : offset + n, :width].reshape(datum.loss_fn_inputs["target_tokens"].shape)
            )
            offset += n
        out.append(per_datum)
    return out


def _shared_chunk(lm_head, hidden_C_H: torch.Tensor, targets_C_K: torch.Tensor, spans) -> torch.Tensor:
    """Target logprobs of a chunk of rows: the base projection over all of them, then each
    span's adapter (LoRA on lm_head) added into its rows only (one span a chunk when lm_head
    has LoRA: see `_unit_logprobs`)."""
    lora_A = getattr(lm_head, "lora_A", None)
    if lora_A is None:
        logits_C_V = lm_head(hidden_C_H)
    else:
        logits_C_V = lm_head.base_layer(hidden_C_H)
        for first, last, name in spans:
            if name in lora_A and last > first:
                A_R_H = lora_A[name].weight
                logits_C_V = logits_C_V.to(A_R_H.dtype)  # a bf16 base's logits: the adapter adds in float32
                down_S_R = (
                    torch.nn.functional.linear(hidden_C_H[first:last].to(A_R_H.dtype), A_R_H) * lm_head.scaling[name]
                )
                # Into a row slice only when the span is not the whole chunk: autograd's
                # backward of an in-place op on a view copies the whole [C, V] gradient.
                target_S_V = logits_C_V if (first, last) == (0, logits_C_V.shape[0]) else logits_C_V[first:last]
                target_S_V.addmm_(down_S_R, lm_head.lora_B[name].weight.t())
    return batching.gathered_logprobs(logits_C_V, targets_C_K)
