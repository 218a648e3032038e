"""The memory model (openrl_core/memory.py) against what the real trainer allocates on the tiny Qwen3.

Resident bytes are exact: the parameters, gradients and Adam moments the engines hold are
summed tensor by tensor. Activations are what autograd keeps for the backward, measured with
`saved_tensors_hooks` (each storage once, parameters excluded); the model's coefficients were
fitted to these, so the test holds them within a few percent and fails if the trainer starts
keeping other tensors.
"""

from __future__ import annotations

import pytest
import torch

from functions.compute.models import load_causal_lm, parameter_count
from functions.trainer import packed
from functions.trainer.engine import TrainerEngine
from functions.trainer.full import FullFinetuneEngine
from functions.trainer.precision import Precision
from openrl_core import memory
from openrl_core.catalog import TINY_QWEN3_CONFIG
from openrl_core.params import LoraConfig
from tests.functions.trainer.conftest import sft_batch

SHAPE = memory.ModelShape.from_config(TINY_QWEN3_CONFIG)
ROWS, TOKENS = 4, 64
BATCH = memory.Batch(ROWS, TOKENS)
CASES = [(p, c) for p in ("float32", "bfloat16") for c in (False, True)]


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def saved_bytes(fn, parameters) -> int:
    """Bytes of every distinct storage autograd saves while `fn` runs, parameters aside."""
    own = {p.untyped_storage().data_ptr() for p in parameters}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(seen.values())


def test_parameter_counts_are_the_model_files(tiny_files):
    model = load_causal_lm(tiny_files)
    assert SHAPE.parameters() == sum(p.numel() for p in model.parameters()) == parameter_count(tiny_files)
    layer = model.get_decoder().layers[0]
    assert SHAPE.layer_parameters() == sum(p.numel() for p in layer.parameters())


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("lora", [LoraConfig(rank=8), LoraConfig(rank=4, train_attn=False, train_unembed=False)])
def test_lora_resident_bytes_are_what_the_engine_allocates(tiny_files, precision, lora):
    engine = TrainerEngine(tiny_files, precision=Precision(precision))
    engine.create_adapter("m", lora)
    engine.forward_backward("m", sft_batch(0, [9, 5]), "cross_entropy", None, False)  # gradients exist
    adapter = engine._adapters["m"]
    allocated = tensor_bytes(
        [*adapter.params.values(), *(p.grad for p in adapter.params.values()),
         *adapter.adam.exp_avg.values(), *adapter.adam.exp_avg_sq.values()]
    )  # fmt: skip
    elements = SHAPE.lora_parameters(lora.rank, lora.train_attn, lora.train_mlp, lora.train_unembed)
    assert allocated == memory.lora_state_bytes(elements) == engine.state_bytes("m")
    assert engine.adapter_bytes_estimate(lora) == allocated
    bytes_per_weight = 4 if precision == "float32" else 2
    assert engine.base_bytes() == SHAPE.parameters() * bytes_per_weight
    estimate = memory.estimate(SHAPE, "lora", precision, lora_rank=lora.rank)
    if lora.train_attn and lora.train_unembed:
        assert (estimate.base, estimate.state) == (engine.base_bytes(), allocated)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_full_resident_bytes_are_what_the_engine_allocates(tiny_files, precision):
    engine = FullFinetuneEngine(tiny_files, precision=Precision(precision))
    engine.create("r")
    engine.forward_backward("r", sft_batch(0, [9, 5]), "cross_entropy", None, False)
    run = engine._runs["r"]
    allocated = tensor_bytes(
        [*run.params.values(), *(p.grad for p in run.params.values()),
         *run.adam.exp_avg.values(), *run.adam.exp_avg_sq.values()]
    )  # fmt: skip
    assert allocated == memory.estimate(SHAPE, "full", precision).resident == engine.state_bytes("r")
    assert engine.state_bytes_estimate() == allocated


@pytest.mark.parametrize("precision, checkpointing", CASES)
def test_activation_bytes_are_what_autograd_keeps(tiny_files, precision, checkpointing):
    """A whole forward_backward: decoder, logits, and (full runs in bf16) autocast's weight copies."""
    batch = sft_batch(0, [TOKENS] * ROWS)
    policy = Precision(precision, checkpointing)
    lora = TrainerEngine(tiny_files, precision=policy)
    lora.create_adapter("m", LoraConfig(rank=8, seed=1))
    kept = saved_bytes(lambda: lora.forward_backward("m", batch, "cross_entropy", None, False), lora._peft.parameters())
    want = memory.estimate(SHAPE, "lora", precision, BATCH, checkpointing=checkpointing, lora_rank=8)
    # Checkpointed, the model also counts one layer's recomputed set, which lives only in the backward.
    assert kept == pytest.approx(want.activations + want.transient, rel=0.03 if not checkpointing else 0.05)
    full = FullFinetuneEngine(tiny_files, precision=policy)
    full.create("r")
    params = list(full._runs["r"].params.values())
    kept = saved_bytes(lambda: full.forward_backward("r", batch, "cross_entropy", None, False), params)
    want = memory.estimate(SHAPE, "full", precision, BATCH, checkpointing=checkpointing)
    assert kept == pytest.approx(want.activations + want.transient, rel=0.03 if not checkpointing else 0.05)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_decoder_activations_per_layer(tiny_files, precision):
    """The decoder alone (no logits, which dominate the tiny model's pass), LoRA path."""
    engine = TrainerEngine(tiny_files, precision=Precision(precision))
    engine.create_adapter("m", LoraConfig(rank=8, seed=1))
    decoder, name = engine._peft.get_decoder(), engine._adapters["m"].name
    ids_B_T = torch.randint(0, 2000, (ROWS, TOKENS), generator=torch.Generator().manual_seed(0))

    def forward():
        with packed._unit_adapters(decoder, [ROWS], [name]):
            decoder(input_ids=ids_B_T, attention_mask=torch.ones_like(ids_B_T), use_cache=False)

    kept = saved_bytes(forward, engine._peft.parameters())
    want = memory.decoder_activation_bytes(SHAPE, BATCH, precision, "lora", lora_rank=8)
    assert kept == pytest.approx(want, rel=0.05)
