"""Weight files: `tensor_files.save` writes exactly what the safetensors library writes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as library_save

from functions.trainer import tensor_files


def _adapter_like(generator: torch.Generator) -> dict[str, torch.Tensor]:
    tensors = {}
    for layer in (11, 2, 0):  # names out of order, and "11" sorts before "2"
        for module, shape in (("q_proj.lora_A", (8, 576)), ("q_proj.lora_B", (576, 8)), ("mlp.up.lora_B", (1536, 8))):
            tensors[f"base_model.model.layers.{layer}.{module}.weight"] = torch.randn(shape, generator=generator)
    tensors["scalar"] = torch.tensor(1.5)
    tensors["empty"] = torch.zeros((0, 3))
    tensors["ünïcode/ключ"] = torch.randn(5, generator=generator)
    tensors["a_param"] = torch.nn.Parameter(torch.randn(4, 4, generator=generator))  # requires grad
    return tensors


def test_save_is_byte_for_byte_the_library_and_loads_back():
    tensors = _adapter_like(torch.Generator().manual_seed(0))
    ours = tensor_files.save(tensors)
    assert ours == library_save({k: v.detach() for k, v in tensors.items()})
    loaded = load_safetensors(ours)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor.detach())


@pytest.mark.parametrize(
    "tensors, metadata",
    [
        ({"half": torch.ones(3, dtype=torch.bfloat16), "f": torch.ones(2)}, None),  # another dtype
        ({"f": torch.ones(2)}, {"format": "x"}),  # metadata
        ({"t": torch.ones(3, 4).t()}, None),  # not contiguous
        ({}, None),
    ],
)
def test_other_cases_go_to_the_library(tensors, metadata):
    expected = (
        library_save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
        if all(v.is_contiguous() for v in tensors.values())
        else None
    )
    if expected is None:
        with pytest.raises(ValueError):  # the library refuses non-contiguous tensors
            tensor_files.save(tensors, metadata=metadata)
    else:
        assert tensor_files.save(tensors, metadata=metadata) == expected


def test_tensors_sharing_storage_are_refused_as_the_library_refuses_them():
    base = torch.ones(4)
    with pytest.raises(RuntimeError):
        library_save({"a": base, "b": base})
    with pytest.raises(RuntimeError):
        tensor_files.save({"a": base, "b": base})
