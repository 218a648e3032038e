"""One process, one copy of a frozen base: the LoRA trainer and the sampler's base engine share
its storage; a full run's sampler copy, which weight sync writes, never does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functions.compute.shared_weights import load_frozen, shares_weights
from functions.sampler.engine import SamplerEngine
from functions.sampler.types import SampleJob
from functions.trainer.engine import TrainerEngine
from openrl_core.datum import Datum
from openrl_core.params import AdamParams, LoraConfig, SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PROMPT = [9707, 11, 1879, 0, 3555, 374, 279]


def greedy(engine: SamplerEngine, adapter=None) -> list[int]:
    params = SamplingParams(max_tokens=6, temperature=0.0)
    job = SampleJob(prompt_tokens=PROMPT, num_samples=1, params=params, adapter=adapter)
    return list(engine.sample([job])[0].sequences[0].tokens)


def test_a_second_frozen_load_is_the_same_storage_and_computes_the_same(tiny_files):
    first, second = load_frozen(tiny_files), load_frozen(tiny_files)
    assert first is not second  # own module trees (own PEFT layers), one storage
    assert shares_weights(first, second)
    assert not any(p.requires_grad for p in second.parameters())
    assert not any(t.is_meta for t in [*second.parameters(), *second.buffers()])
    assert second.lm_head.weight is second.model.embed_tokens.weight  # ties survive
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(first(ids).logits, second(ids).logits)


def test_trainer_and_sampler_base_share_storage_and_training_leaves_it_unwritten(tiny_files):
    trainer = TrainerEngine(tiny_files)
    shared = SamplerEngine(tiny_files, share_base=True)
    own = SamplerEngine(tiny_files)  # a full run's copy loads its own
    assert shares_weights(trainer._base, shared.model)
    assert not shares_weights(own.model, shared.model)
    before = greedy(own)
    assert greedy(shared) == before
    snapshot = {name: p.detach().clone() for name, p in shared.model.named_parameters()}

    lora = LoraConfig(rank=4, seed=3)
    trainer.create_adapter("m", lora)
    tokens = np.array(PROMPT, dtype=np.int64)
    datum = Datum(tokens[:-1], {"target_tokens": tokens[1:].copy(), "weights": np.ones(len(PROMPT) - 1, np.float32)})
    for _ in range(3):
        trainer.forward_backward("m", [datum], "cross_entropy", None, False)
        trainer.optim_step("m", AdamParams(learning_rate=0.05))

    # The trainer trained its adapter only: the shared base reads bitwise as before.
    assert all(torch.equal(p, snapshot[name]) for name, p in shared.model.named_parameters())
    assert greedy(shared) == before
    # The adapter it trained serves from the shared base as from a private one.
    files = trainer.export_adapter("m")
    shared.load_adapter("v1", files)
    own.load_adapter("v1", files)
    assert greedy(shared, "v1") == greedy(own, "v1")
    assert shares_weights(trainer._base, shared.model)
