"""Training works: a few LoRA steps of cross-entropy on real text with pretrained SmolLM2."""

from __future__ import annotations

import numpy as np

from functions.compute.models import load_tokenizer
from functions.trainer.engine import TrainerEngine
from openrl_core.datum import Datum
from openrl_core.params import AdamParams, LoraConfig

TEXT = "Pack my box with five dozen liquor jugs."


def test_ten_steps_of_sft_lower_the_loss_on_smollm2(smol_files):
    """Default LoRA (attn, mlp and unembed): gradients cross every layer of a pretrained model."""
    tokens = np.asarray(load_tokenizer(smol_files)(TEXT)["input_ids"], dtype=np.int64)
    datum = Datum(tokens[:-1], {"target_tokens": tokens[1:].copy(), "weights": np.ones(len(tokens) - 1, np.float32)})
    engine = TrainerEngine(smol_files)
    engine.create_adapter("sft", LoraConfig(rank=8, seed=0))
    losses = []  # mean loss per token before each update
    for _ in range(10):
        result = engine.forward_backward("sft", [datum], "cross_entropy", None, forward_only=False)
        losses.append(result.metrics["loss:sum"] / (len(tokens) - 1))
        engine.optim_step("sft", AdamParams(learning_rate=1e-3))
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(later < earlier for earlier, later in zip(losses[:3], losses[1:4])), losses
