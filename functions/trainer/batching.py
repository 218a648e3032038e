"""From a list of datums to per-datum target logprobs, without materialising full-vocab logits.

Contract: `target_logprobs(decoder, lm_head, batch)` returns, for each datum, a float32 tensor
shaped like its `target_tokens` ([N] or [N, K]) holding log_softmax(logits[i])[target[i, k]],
differentiable w.r.t. the adapter's parameters when grad is enabled.

Datums are right-padded into one [B, T] batch with an attention mask. With right padding and
a causal model, a real position never attends to a pad, so its output does not depend on the
padding; position ids stay 0..n-1. Only the real positions' hidden states are projected to the
vocabulary, in chunks of rows: a [rows, V] float32 logits block exists for one chunk at a
time, and under autograd a pass whose logits would exceed `KEEP_LOGITS_ELEMENTS` has each chunk
checkpointed (recomputed during backward) so no full [B, T, V] tensor is kept for the backward
pass either; smaller passes keep their chunks' logits (the recompute would cost a third more
vocabulary products for memory that fits anyway). `microbatches` bounds the padded
[B, T] size of one forward pass and groups datums of similar length only, so that little
compute goes to padding; since the loss is a sum over datums, running microbatches one after
another and accumulating gradients is exact.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from openrl_core.datum import Datum

# Rows x vocab elements in one logits chunk: 2**24 float32 = 64 MiB (about 110 rows for a
# 151936-token vocabulary). A chunk's backward holds a few such blocks (recomputed logits,
# softmax, gradient): 2000 tokens through the tiny Qwen3 peak about 0.4 GiB above idle, where
# full logits alone would be 1.2 GiB. Halving from 2**25 cost no measurable speed.
LOGITS_CHUNK_ELEMENTS = 2**24
# Logits elements a pass may keep for its backward (float32: 2**26 = 256 MiB) rather than
# recompute them. Plain peft keeps twice that for the same batch (logits and log-softmax);
# the packer's per-token cost (`engine.token_bytes`) already counts a kept logits row.
KEEP_LOGITS_ELEMENTS = 2**26
PAD_TOKEN = 0  # any valid id; pads are masked out and never gathered
# Padding costs decoder compute while batching gains little on CPU (about 10% for 8 datums of
# equal length through SmolLM2): group datums only when they pad at most this fraction.
MAX_PADDING = 0.1


def microbatches(batch: Sequence[Datum], max_padded_tokens: int, max_padding: float = MAX_PADDING) -> list[list[int]]:
    """Groups of datum indices whose padded size B * max(N) fits the budget and wastes little.

    Datums are taken in order of length (stable, so the grouping is deterministic) and a group
    closes when it would exceed `max_padded_tokens` or pad more than `max_padding` of its real
    tokens. A lone datum longer than the budget is its own group.
    """
    order = sorted(range(len(batch)), key=lambda index: int(batch[index].tokens_N.size))
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for index in order:
        length = int(batch[index].tokens_N.size)  # the group's longest, since lengths only grow
        padded = length * (len(current) + 1)
        if current and (padded > max_padded_tokens or padded > (1.0 + max_padding) * (real + length)):
            groups.append(current)
            current, real = [], 0
        current.append(index)
        real += length
    if current:
        groups.append(current)
    return groups


def pad_right(batch: Sequence[Datum], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = [int(d.tokens_N.size) for d in batch]
    tokens_B_T = np.full((len(batch), max(lengths)), PAD_TOKEN, dtype=np.int64)
    mask_B_T = np.zeros((len(batch), max(lengths)), dtype=np.int64)
    for row, datum in enumerate(batch):
        tokens_B_T[row, : lengths[row]] = datum.tokens_N
        mask_B_T[row, : lengths[row]] = 1
    return torch.from_numpy(tokens_B_T).to(device), torch.from_numpy(mask_B_T).to(device)


def target_logprobs(decoder: torch.nn.Module, lm_head: torch.nn.Module, batch: Sequence[Datum]) -> list[torch.Tensor]:
    device = lm_head.weight.device
    tokens_B_T, mask_B_T = pad_right(batch, device)
    hidden_B_T_H = decoder(input_ids=tokens_B_T, attention_mask=mask_B_T, use_cache=False).last_hidden_state

    lengths = [int(d.tokens_N.size) for d in batch]
    hidden_P_H = torch.cat([hidden_B_T_H[row, :n] for row, n in enumerate(lengths)])
    targets_P_K, widths = _stack_targets(batch, device)

    vocab = lm_head.weight.shape[0]
    rows = max(1, LOGITS_CHUNK_ELEMENTS // vocab)
    recompute = recomputes_logits(hidden_P_H.shape[0], vocab)
    pieces = []
    for start in range(0, hidden_P_H.shape[0], rows):
        hidden_C_H, targets_C_K = hidden_P_H[start : start + rows], targets_P_K[start : start + rows]
        if recompute:
            pieces.append(checkpoint(_chunk_logprobs, lm_head, hidden_C_H, targets_C_K, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(lm_head, hidden_C_H, targets_C_K))
    logprobs_P_K = torch.cat(pieces)

    out, offset = [], 0
    for datum, n, width in zip(batch, lengths, widths):
        logprobs_S = logprobs_P_K[offset : offset + n, :width]
        offset += n
        out.append(logprobs_S.reshape(datum.loss_fn_inputs["target_tokens"].shape))
    return out


def recomputes_logits(positions: int, vocab: int) -> bool:
    """Whether a pass over `positions` real positions checkpoints its logits chunks."""
    return torch.is_grad_enabled() and positions * vocab > KEEP_LOGITS_ELEMENTS


def _chunk_logprobs(lm_head: torch.nn.Module, hidden_C_H: torch.Tensor, targets_C_K: torch.Tensor) -> torch.Tensor:
    return gathered_logprobs(_project(lm_head, hidden_C_H), targets_C_K)


def gathered_logprobs(logits_C_V: torch.Tensor, targets_C_K: torch.Tensor) -> torch.Tensor:
    """log softmax of each row's logits (in float32) at its target ids."""
    return _GatheredLogprobs.apply(logits_C_V.float(), targets_C_K)


class _GatheredLogprobs(torch.autograd.Function):
    """logits[t] - logsumexp(logits), with a backward that reuses the logits' memory.

    The gradient is onehot(t) * g - softmax(logits) * sum_k g_k. Left to autograd, the
    logsumexp and gather backwards each fill a fresh [C, V] block (exp(x - lse), a zero block
    to scatter into) and a third adds them: five passes over the logits where this takes three
    and allocates nothing, which is most of the step on a small model with a large vocabulary.
    The arithmetic is autograd's own (the same products and sums), so the numbers are too.
    The logits (the projection's output; nothing else keeps them) are overwritten in place, so
    the graph cannot be back-propagated twice through here.
    """

    @staticmethod
    def forward(ctx, logits_C_V: torch.Tensor, targets_C_K: torch.Tensor) -> torch.Tensor:
        logsumexp_C = torch.logsumexp(logits_C_V, dim=-1, keepdim=True)
        ctx.save_for_backward(logits_C_V, logsumexp_C, targets_C_K)
        ctx.spent = False
        return logits_C_V.gather(-1, targets_C_K) - logsumexp_C

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_C_K: torch.Tensor):
        if ctx.spent:
            raise RuntimeError("gathered_logprobs: its saved logits were consumed by a first backward")
        ctx.spent = True
        logits_C_V, logsumexp_C, targets_C_K = ctx.saved_tensors
        grad_C_V = logits_C_V.sub_(logsumexp_C).exp_().mul_(-grad_C_K.sum(-1, keepdim=True))
        return grad_C_V.scatter_add_(-1, targets_C_K, grad_C_K), None


def _project(lm_head: torch.nn.Module, hidden_C_H: torch.Tensor) -> torch.Tensor:
    """lm_head(hidden), with a LoRA on lm_head added in place into the base logits.

    PEFT's LoRA Linear computes base(x) + B(A(x)) * scaling, which allocates two more
    [rows, V] blocks; for the vocabulary projection those dominate the step's time and memory.
    Adding scaling * A(x) @ B^T into the base logits with one addmm_ is the same sum (autograd
    allows it: a linear layer does not keep its output for backward).
    """
    lora_A = getattr(lm_head, "lora_A", None)
    if lora_A is None or getattr(lm_head, "merged", False) or getattr(lm_head, "disable_adapters", False):
        return lm_head(hidden_C_H)
    if any(getattr(lm_head, "use_dora", {}).get(name, False) for name in lm_head.active_adapters):
        return lm_head(hidden_C_H)
    logits_C_V = lm_head.base_layer(hidden_C_H)
    for name in lm_head.active_adapters:
        if name in lora_A:
            A_R_H = lora_A[name].weight
            logits_C_V = logits_C_V.to(A_R_H.dtype)  # a bf16 base's logits: the adapter adds in float32
            down_C_R = torch.nn.functional.linear(hidden_C_H.to(A_R_H.dtype), A_R_H) * lm_head.scaling[name]
            logits_C_V = logits_C_V.addmm_(down_C_R, lm_head.lora_B[name].weight.t())
    return logits_C_V


def _stack_targets(batch: Sequence[Datum], device: torch.device | str) -> tuple[torch.Tensor, list[int]]:
    """All datums' targets as one [P, K_max] block (padded with a valid id), plus each datum's K."""
    targets = [np.asarray(d.loss_fn_inputs["target_tokens"], dtype=np.int64) for d in batch]
    widths = [1 if t.ndim == 1 else int(t.shape[1]) for t in targets]
    k_max = max(widths)
    block = np.full((sum(t.shape[0] for t in targets), k_max), PAD_TOKEN, dtype=np.int64)
    offset = 0
    for t, width in zip(targets, widths):
        block[offset : offset + t.shape[0], :width] = t.reshape(t.shape[0], width)
        offset += t.shape[0]
    return torch.from_numpy(block).to(device), widths
