"""Checkpoint weight files: writing them, and reading one into a model's parameters with
every check before any write.

Shared by LoRA adapters and full fine-tuning runs: the file must be readable safetensors
holding exactly the parameters' names, each with the parameter's shape; only then is
anything copied, so a bad checkpoint leaves the model as it was.

`save` writes the bytes `safetensors.torch.save` writes (tested byte for byte), faster for
the case every save of an RL step hits: float32 tensors on the CPU. A LoRA adapter is
hundreds of small tensors (SmolLM2, r8: 422, 11 MB), and the library converts each through
numpy and ctypes before its serializer copies them again: 28 ms a save, against a few ms
for one concatenation here. Anything else (other dtypes, shared storage, metadata) goes to
the library.
"""

from __future__ import annotations

import json
import struct
from typing import Mapping, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from openrl_core.errors import InvalidRequest


def save(tensors: Mapping[str, torch.Tensor], metadata: Optional[dict[str, str]] = None) -> bytes:
    """The safetensors file of `tensors`, byte for byte what `safetensors.torch.save` gives."""
    values = list(tensors.values())
    storages = {t.untyped_storage().data_ptr() for t in values}
    if (
        metadata
        or not values
        or len(storages) != len(values)
        or any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in values)
    ):
        return save_safetensors(dict(tensors), metadata=metadata)
    # The library's layout: tensors by name (all of one dtype here), data in that order, a
    # compact JSON header padded with spaces to a multiple of 8 bytes.
    names = sorted(tensors)
    entries, offset = [], 0
    for name in names:
        size = tensors[name].numel() * 4
        shape = ",".join(str(n) for n in tensors[name].shape)
        entries.append(
            f'{json.dumps(name, ensure_ascii=False)}:{{"dtype":"F32","shape":[{shape}],"data_offsets":[{offset},{offset + size}]}}'
        )
        offset += size
    header = ("{" + ",".join(entries) + "}").encode()
    header += b" " * ((8 - len(header) % 8) % 8)
    out = bytearray(8 + len(header) + offset)
    out[:8] = struct.pack("<Q", len(header))
    out[8 : 8 + len(header)] = header
    if offset:
        data = torch.frombuffer(out, dtype=torch.float32, offset=8 + len(header), count=offset // 4)
        with torch.no_grad():
            torch.cat([tensors[name].detach().reshape(-1) for name in names], out=data)
    return bytes(out)


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
