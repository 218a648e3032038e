"""Reading a checkpoint's weight file into a model's parameters: every check before any write.

Shared by LoRA adapters and full fine-tuning runs: the file must be readable safetensors
holding exactly the parameters' names, each with the parameter's shape; only then is
anything copied, so a bad checkpoint leaves the model as it was.
"""

from __future__ import annotations

from typing import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from openrl_core.errors import InvalidRequest


def read(files: Mapping[str, bytes], name: str) -> dict[str, torch.Tensor]:
    if name not in files:
        raise InvalidRequest(f"the checkpoint has no {name}")
    try:
        return load_safetensors(files[name])
    except (ValueError, RuntimeError, SafetensorError) as error:
        raise InvalidRequest(f"{name} is unreadable: {error}") from error


def check_fit(tensors: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], name: str, target: str) -> None:
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise InvalidRequest(f"{name} does not fit {target}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for key, param in params.items():
        if tuple(tensors[key].shape) != tuple(param.shape):
            raise InvalidRequest(f"{name}: {key} has shape {list(tensors[key].shape)}, expected {list(param.shape)}")


@torch.no_grad()
def copy_into(params: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    for key, param in params.items():
        param.copy_(tensors[key].to(device=param.device, dtype=param.dtype))
