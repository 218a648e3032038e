"""The trainer's precision policy: which dtype each tensor is held in and computed in.

`Precision.resolve(setting, device)` turns the `trainer_precision` setting into a policy:
`auto` is bf16 on CUDA and float32 everywhere else (the CPU keeps its bitwise tests).

| tensor                                   | float32 | bfloat16                        |
|------------------------------------------|---------|---------------------------------|
| LoRA: frozen base weights                | float32 | bf16 (half the bytes)           |
| LoRA: adapter weights, grads, Adam state | float32 | float32                         |
| LoRA: adapter products (x A^T B^T)       | float32 | float32 (inputs cast per use)   |
| full: master weights, grads, Adam state  | float32 | float32                         |
| full: matrix products                    | float32 | bf16 under `torch.autocast`     |
| log-softmax over the vocabulary, losses  | float32 | float32                         |

Why these: an Adam update is often below bf16's resolution of a weight (8 bits of mantissa),
so whatever is *trained* stays float32 and only what is *read* (a frozen base, a forward's
products) drops to bf16. The logits are upcast before the log-softmax so that logprobs and
the losses built on them keep float32 resolution. The LoRA path needs no autocast: its base
weights are bf16 already, so the decoder computes in bf16, and the adapter's own products are
float32 (see `packed._LayerLora`). Attention is PyTorch SDPA (`attn_implementation="sdpa"`):
on CUDA its flash and memory-efficient kernels keep no T x T matrix.

`activation_checkpointing` wraps each decoder layer in `torch.utils.checkpoint`
(non-reentrant): a pass keeps only each layer's input and recomputes the rest in the
backward, which trades about a third more compute for activations that no longer grow with
the layer count (openrl_core/memory.py has the bytes). Recomputation is the same arithmetic,
so on CPU the numbers are bitwise those without it.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

from openrl_core import memory
from openrl_core.errors import InvalidRequest

Setting = Literal["auto", "float32", "bfloat16"]
SETTINGS: tuple[str, ...] = ("auto", "float32", "bfloat16")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_WRAPPED = "_openrl_checkpointed"  # on a decoder layer: its forward is checkpointed


@dataclass(frozen=True)
class Precision:
    name: Literal["float32", "bfloat16"] = "float32"
    activation_checkpointing: bool = False

    @classmethod
    def resolve(cls, setting: str, device: str, activation_checkpointing: bool = False) -> "Precision":
        if setting not in SETTINGS:
            raise InvalidRequest(f"unknown trainer precision {setting!r}; choose one of {', '.join(SETTINGS)}")
        return cls(memory.resolve_precision(setting, torch.device(device).type), activation_checkpointing)

    @property
    def base_dtype(self) -> torch.dtype:
        """The dtype a LoRA engine holds its frozen base in."""
        return _DTYPES[self.name]

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of whatever is trained: adapters, full runs' weights, gradients, moments."""
        return torch.float32

    def autocast(self, device: torch.device | str):
        """The context a full run's forward runs in: bf16 autocast, or nothing for float32."""
        if self.name == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(device).type, dtype=_DTYPES[self.name])

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Set SDPA attention and, when asked, checkpoint every decoder layer (in place)."""
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            try:
                model.set_attn_implementation("sdpa")
            except (AttributeError, ValueError):
                pass  # a model that does not support SDPA keeps its own attention
        if self.activation_checkpointing:
            checkpoint_layers(model)
        return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks of a Llama/Qwen-family model (through PEFT's wrappers)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise InvalidRequest(f"{type(model).__name__}: no decoder layers to checkpoint")
    return list(layers)


def checkpoint_layers(model: torch.nn.Module) -> None:
    """Each decoder layer's forward recomputes in the backward instead of keeping its activations.

    HF's own `gradient_checkpointing_enable` acts only in training mode, and the trainer keeps
    models in eval mode (no dropout: a step is a deterministic function of weights and data),
    so the layers are wrapped here. Idempotent."""
    for layer in decoder_layers(model):
        if getattr(layer, _WRAPPED, False):
            continue
        layer.forward = functools.partial(_checkpointed, type(layer).forward.__get__(layer))
        setattr(layer, _WRAPPED, True)


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
