"""One forward (and backward) pass of a batch through a model, however its weights are held.

`run(decoder, lm_head, batch, ...)` is shared by the LoRA engine (a PEFT model whose
active adapter is the only thing with gradients) and full fine-tuning (a model whose every
weight has them): microbatches bound the padded size of one forward, each datum's loss is
the Tinker sum over its targets (`losses.datum_loss`), and unless `forward_only` each
microbatch's loss is back-propagated at once, so gradients accumulate in the parameters
until the optimizer step. The batch loss is a plain sum, so microbatching is exact.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import numpy as np
import torch

from functions.trainer import batching
from functions.trainer.losses import datum_loss
from openrl_core.datum import Datum

# Bound on B * max(N) for one forward pass; larger batches run as consecutive microbatches.
DEFAULT_MAX_PADDED_TOKENS = 8192


@dataclass(frozen=True)
class ForwardBackwardResult:
    logprobs: list[np.ndarray]  # one per datum, float32, shaped like its target_tokens
    metrics: dict[str, float]  # {"loss:sum": ...}


def run(
    decoder: torch.nn.Module,
    lm_head: torch.nn.Module,
    batch: list[Datum],
    loss_fn: str,
    config: dict[str, float],
    forward_only: bool,
    device: torch.device,
    max_padded_tokens: int = DEFAULT_MAX_PADDED_TOKENS,
    max_padding: float = batching.MAX_PADDING,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
) -> ForwardBackwardResult:
    """`autocast()` is the context the model's forward runs in (precision.Precision.autocast);
    the losses and the backward run outside it, in float32."""
    logprobs: list[np.ndarray | None] = [None] * len(batch)
    loss_sum = 0.0
    for group in batching.microbatches(batch, max_padded_tokens, max_padding):
        micro = [batch[i] for i in group]
        with torch.set_grad_enabled(not forward_only):
            with autocast():
                logprobs_D = batching.target_logprobs(decoder, lm_head, micro)
            loss = batch_loss(loss_fn, config, micro, logprobs_D, device)
            if loss.requires_grad:
                loss.backward()
        loss_sum += float(loss.detach())
        for index, logprobs_S in zip(group, logprobs_D):
            logprobs[index] = logprobs_S.detach().cpu().numpy().astype(np.float32, copy=False)
    return ForwardBackwardResult(logprobs=logprobs, metrics={"loss:sum": loss_sum})


def batch_loss(
    loss_fn: str, config: dict[str, float], micro: list[Datum], logprobs_D: list[torch.Tensor], device: torch.device
) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    for datum, logprobs_S in zip(micro, logprobs_D):
        inputs = {
            key: torch.from_numpy(np.asarray(value, dtype=np.float32)).to(device)
            for key, value in datum.loss_fn_inputs.items()
            if key != "target_tokens"
        }
        total = total + datum_loss(loss_fn, logprobs_S, inputs, config)
    return total
