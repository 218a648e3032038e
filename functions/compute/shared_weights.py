"""Frozen base weights held once per process, shared by every engine that only reads them.

`openrl serve` runs the LoRA trainer and the sampler in one process, on the same base model:
both keep the base frozen (LoRA trains and serves adapters beside it, never in it), so two
copies of the same float32 tensors (0.54 GB each for SmolLM2-135M) are pure waste.
`load_frozen(files, dtype, device)` returns a model whose parameters and buffers are the very
tensors of the first model loaded for the same (files, dtype, device); the second engine gets
a fresh module tree (its own PEFT layers, its own adapters) around the same storage.

Contract, which callers must keep:
- Only engines that never write their base weights may call it: the LoRA trainer (its base
  has requires_grad False, and parking moves only adapters) and the sampler's base engine.
  A full fine-tuning run's weights (trainer or a sampler's copy patched by weight sync) are
  loaded with `models.load_causal_lm`, never here.
- Shared tensors live while any model built on them lives (each model holds its group);
  the registry keeps only weak references, so the memory goes with the last engine.
- Separate processes (the distributed roles) share nothing: each loads its own copy.
"""

from __future__ import annotations

import threading
import weakref

import torch

from functions.compute.models import ModelFiles, load_causal_lm

_ATTR = "_openrl_shared_base"  # on a model: the _Shared it uses, so the tensors outlive the registry


class _Shared:
    """The tensors of one loaded base, by their qualified names in the plain model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.parameters = dict(model.named_parameters(remove_duplicate=False))
        self.buffers = dict(model.named_buffers(remove_duplicate=False))


_registry: "weakref.WeakValueDictionary[tuple, _Shared]" = weakref.WeakValueDictionary()
_lock = threading.Lock()


def load_frozen(files: ModelFiles, dtype=None, device: str = "cpu") -> torch.nn.Module:
    """A frozen model (eval mode, no gradients) over this process's one copy of the weights."""
    dtype = dtype or torch.float32
    key = (str(files.path), str(dtype), str(torch.device(device)))
    with _lock:
        shared = _registry.get(key)
        if shared is None:
            model = load_causal_lm(files, dtype=dtype, device=device)
            model.eval().requires_grad_(False)
            shared = _Shared(model)
            _registry[key] = shared
        else:
            model = _skeleton(files, dtype)
            _adopt(model, shared)
        setattr(model, _ATTR, shared)
        return model


def shares_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two models' base parameters are the same storage (tests, diagnostics)."""

    def storage(model: torch.nn.Module) -> set[int]:
        return {p.data_ptr() for name, p in model.named_parameters() if "lora_" not in name}

    ours, theirs = storage(a), storage(b)
    return bool(ours) and ours == theirs


def _skeleton(files: ModelFiles, dtype) -> torch.nn.Module:
    """The model's module tree with no storage behind its weights (the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(files.path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _adopt(model: torch.nn.Module, shared: _Shared) -> None:
    """Point every parameter and buffer of `model` at the shared tensor of the same name."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    if names != set(shared.parameters):
        raise RuntimeError("a model built from the same files has other parameters than the shared base")
    for name in names:
        module, leaf = _owner(model, name)
        module._parameters[leaf] = shared.parameters[name]
    for name, _ in list(model.named_buffers(remove_duplicate=False)):
        module, leaf = _owner(model, name)
        module._buffers[leaf] = shared.buffers[name]


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf
