"""The memory model against hand-computed values, and docs/memory.md against its generator."""

from __future__ import annotations

from pathlib import Path

import pytest

from openrl_core import memory, memory_table
from openrl_core.catalog import PUBLISHED_CONFIGS, SMOLLM2_135M, TINY_QWEN3, TINY_QWEN3_CONFIG
from openrl_core.errors import InvalidRequest
from openrl_core.memory import Batch, ModelShape

TINY = ModelShape.from_config(TINY_QWEN3_CONFIG)
DOC = Path(__file__).resolve().parents[2] / "docs" / "memory.md"


def test_the_tiny_qwen3_counted_by_hand():
    # embedding 151936 x 128 (tied: once); per layer q 128x256, k and v 128x128, o 256x128,
    # gate and up 128x384, down 384x128, two RMSNorms of 128, q_norm and k_norm of 64.
    layer = 128 * 256 + 2 * 128 * 128 + 256 * 128 + 3 * 128 * 384 + 2 * 128 + 2 * 64
    assert TINY.layer_parameters() == layer == 246_144
    assert TINY.parameters() == 151936 * 128 + 2 * layer + 128
    # rank 8 on every linear: 8 * (in + out) each, then lm_head 8 * (128 + 151936)
    per_layer = 8 * ((128 + 256) + 2 * (128 + 128) + (256 + 128) + 2 * (128 + 384) + (384 + 128))
    assert TINY.lora_parameters(8) == 2 * per_layer + 8 * (128 + 151936) == 1_261_568
    assert TINY.lora_parameters(8, unembed=False) == 2 * per_layer
    assert TINY.lora_parameters(4, attn=False, unembed=False) == 2 * 4 * (2 * (128 + 384) + (384 + 128))


@pytest.mark.parametrize(
    "name, total_billions, non_embedding_billions",
    # The model cards' "Number of Parameters" and "(Non-Embedding)".
    [("Qwen/Qwen3-1.7B", 1.7, 1.4), ("Qwen/Qwen3-4B", 4.0, 3.6), ("Qwen/Qwen3-8B", 8.2, 6.95)],
)
def test_published_qwen3_sizes_match_their_model_cards(name, total_billions, non_embedding_billions):
    shape = ModelShape.from_config(PUBLISHED_CONFIGS[name])
    embeddings = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    assert round(shape.parameters() / 1e9, 1) == total_billions
    assert abs((shape.parameters() - embeddings) / 1e9 - non_embedding_billions) < 0.06


def test_resident_bytes_by_kind_precision_and_shards():
    p = TINY.parameters()
    lora32 = memory.estimate(TINY, "lora", "float32", lora_rank=8)
    lora16 = memory.estimate(TINY, "lora", "bfloat16", lora_rank=8)
    assert (lora32.base, lora32.state) == (4 * p, 16 * 1_261_568)
    assert (lora16.base, lora16.state) == (2 * p, 16 * 1_261_568)  # the adapter stays float32
    full32 = memory.estimate(TINY, "full", "float32")
    full16 = memory.estimate(TINY, "full", "bfloat16")
    assert full32.resident == full16.resident == 16 * p and full32.base == 0
    assert (full32.transient, full16.transient) == (0, 2 * p)  # autocast's bf16 weight copies
    sharded = memory.estimate(TINY, "full", "bfloat16", shards=3)
    assert sharded.state == 16 * -(-p // 3)  # ceil: FSDP pads the last shard
    assert sharded.transient == 2 * 2 * TINY.layer_parameters()  # two gathered bf16 layers


def test_activation_bytes_by_hand():
    batch = Batch(rows=2, tokens=10)
    s = 6 * 128 + 4 * 256 + 4 * 128 + 4 * 384  # elements of one layer's saved set, per token
    logits = 4 * 20 * 151936
    assert memory.activation_bytes(TINY, batch, "float32", "full") == 20 * (2 * 4.0 * s + 2 * 4 * 128) + logits
    lora = memory.activation_bytes(TINY, batch, "bfloat16", "lora", lora_rank=8)
    assert lora == int(20 * (2 * (2.0 * s + 4 * 8 * 7) + 2 * 2 * 128)) + logits
    checkpointed = memory.activation_bytes(TINY, batch, "float32", "full", checkpointing=True)
    assert checkpointed == 20 * (4 * 128 * 2 + 4.0 * s + 2 * 4 * 128) + logits
    # Past KEEP_LOGITS_ELEMENTS the logits are recomputed chunk by chunk: they stop growing.
    big = Batch(rows=64, tokens=4096)
    assert memory.logits_bytes(TINY, big) == 4 * memory.KEEP_LOGITS_ELEMENTS


def test_peak_and_fit():
    e = memory.Estimate(base=10, state=20, transient=5, activations=65)
    assert (e.resident, e.peak) == (30, 100)
    assert memory.fits(e, 112) and not memory.fits(e, 110)


def test_bad_inputs_are_refused():
    with pytest.raises(InvalidRequest):
        memory.estimate(TINY, "lora", "float16")
    with pytest.raises(InvalidRequest):
        memory.estimate(TINY, "lora", "float32", shards=2)
    with pytest.raises(InvalidRequest):
        memory.estimate(TINY, "qlora", "float32", Batch(1, 8))
    with pytest.raises(InvalidRequest):
        memory.full_state_bytes(100, shards=0)
    with pytest.raises(InvalidRequest):
        ModelShape.from_config({"hidden_size": 8})


def test_shapes_of_known_models():
    assert memory.shape_of(TINY_QWEN3) == TINY
    assert memory.shape_of(SMOLLM2_135M).parameters() == 134_515_008  # SmolLM2-135M's tensors
    assert memory.shape_of("Qwen/Qwen3-8B").tie_word_embeddings is False
    assert memory.shape_of("someone/unknown") is None


def test_docs_memory_md_is_current():
    assert DOC.read_text() == memory_table.render(), "regenerate: python -m openrl_core.memory_table > docs/memory.md"
