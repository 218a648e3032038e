"""The torch engine's stability records: each sampled token's logprob under the distribution it
was drawn from, against a reference computed here from a plain forward pass of the whole
sequence (no KV cache), in float64, with temperature, top-k and top-p written out again by
sorting (not through `processing`). Recording changes nothing else: the same seeded job gives
the same tokens and raw logprobs with and without it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functions.compute.models import load_causal_lm
from functions.sampler.engine import SamplerEngine
from functions.sampler.stability import stability_entry
from functions.sampler.types import SampleJob
from openrl_core.params import SamplingParams

PROMPT = [9707, 11, 1879, 0, 3555, 374, 279]
PARAMS = [
    SamplingParams(max_tokens=6, seed=3, temperature=0.7, top_k=20, top_p=0.9),
    SamplingParams(max_tokens=6, seed=4, temperature=1.3, top_p=0.8),
    SamplingParams(max_tokens=6, seed=5),  # the raw distribution: equals the reported logprobs
    SamplingParams(max_tokens=6, seed=6, temperature=0.0),  # greedy: certain
]


@pytest.fixture(scope="module")
def engine(tiny_files):
    return SamplerEngine(tiny_files, max_batch_rows=64)


@pytest.fixture(scope="module")
def model(tiny_files):
    return load_causal_lm(tiny_files).eval()


def reference_logprob(logits_V: torch.Tensor, token: int, params: SamplingParams) -> float:
    if params.temperature == 0:
        return 0.0
    scaled = logits_V.double() / params.temperature
    order = torch.argsort(scaled, descending=True)
    keep = torch.zeros_like(scaled, dtype=torch.bool)
    k = params.top_k if params.top_k > 0 else scaled.numel()
    candidates = order[:k]
    probs = torch.softmax(scaled[candidates], dim=0)
    before = torch.cumsum(probs, dim=0) - probs
    keep[candidates[before < params.top_p]] = True
    log_norm = torch.logsumexp(scaled[keep], dim=0)
    assert keep[token], "the engine drew a token outside the kept set"
    return float(scaled[token] - log_norm)


def test_records_hold_the_sampling_distributions_logprobs(engine, model):
    jobs = [SampleJob(PROMPT, 3, params, record_stability_info=True) for params in PARAMS]
    results = engine.sample(jobs)
    for params, result in zip(PARAMS, results):
        for sequence in result.sequences:
            full = torch.tensor([PROMPT + sequence.tokens])
            with torch.no_grad():
                logits_T_V = model(full).logits[0]
            expected = [
                reference_logprob(logits_T_V[len(PROMPT) - 1 + i], token, params)
                for i, token in enumerate(sequence.tokens)
            ]
            np.testing.assert_allclose(sequence.sampling_logprobs, expected, rtol=1e-4, atol=1e-4)
            if params.temperature == 1.0 and params.top_p == 1.0 and params.top_k == -1:
                assert sequence.sampling_logprobs == sequence.logprobs
        entry = stability_entry(PROMPT, result)
        assert entry["prompt_tokens"] == PROMPT
        assert entry["sampling_logprobs"] == [s.sampling_logprobs for s in result.sequences]


def test_recording_changes_no_draw(engine):
    plain = engine.sample([SampleJob(PROMPT, 3, PARAMS[0])])[0]
    recorded = engine.sample([SampleJob(PROMPT, 3, PARAMS[0], record_stability_info=True)])[0]
    assert [s.tokens for s in plain.sequences] == [s.tokens for s in recorded.sequences]
    assert [s.logprobs for s in plain.sequences] == [s.logprobs for s in recorded.sequences]
    assert all(s.sampling_logprobs is None for s in plain.sequences)
