"""Randomness of SamplerEngine on the tiny Qwen3: seeds, waves, and the sampled distribution.

The distribution checks compare first-token frequencies with the float64 softmax of a
plain forward pass of the prompt (an independent computation), by chi-square.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functions.compute.models import load_causal_lm
from functions.sampler.engine import Piece, SamplerEngine, plan_waves
from functions.sampler.types import SampleJob
from openrl_core.params import SamplingParams

PROMPT = [9707, 11, 1879, 0, 3555, 374, 279]
OTHER = [40, 1079, 264, 2805, 11, 1221, 4128, 911, 13, 576, 525, 1045, 279, 1156]
CHI2_20_DOF_P1E4 = 52.4  # chi-square quantile: a correct sampler fails with p < 1e-4
CHI2_4_DOF_P1E4 = 23.5


@pytest.fixture(scope="module")
def engine(tiny_files):
    return SamplerEngine(tiny_files, max_batch_rows=256)


@pytest.fixture(scope="module")
def first_token_probs(tiny_files):
    model = load_causal_lm(tiny_files).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1].double()
    return logits


def tokens_of(result):
    return [s.tokens for s in result.sequences]


def test_plan_waves_packs_in_order_and_splits_big_jobs():
    assert plan_waves([3, 2, 6], 4) == [
        [Piece(0, 0, 3), Piece(1, 0, 1)],
        [Piece(1, 1, 1), Piece(2, 0, 3)],
        [Piece(2, 3, 3)],
    ]
    assert plan_waves([4], 4) == [[Piece(0, 0, 4)]]


def test_plan_waves_bounds_the_prefill_logits():
    # Job 1 wants 50 logit columns: with a budget of 100 it shares a wave with one other
    # piece at most (2 x 50); job 3 (120 columns) exceeds the budget and runs alone.
    waves = plan_waves([1, 1, 1, 1, 1], 64, [1, 50, 1, 120, 1], 100)
    assert waves == [
        [Piece(0, 0, 1), Piece(1, 0, 1)],
        [Piece(2, 0, 1)],
        [Piece(3, 0, 1)],
        [Piece(4, 0, 1)],
    ]
    # Only a split job's first piece computes prompt logprobs.
    assert plan_waves([3, 1], 2, [80, 1], 100) == [[Piece(0, 0, 2)], [Piece(0, 2, 1), Piece(1, 0, 1)]]


def test_same_seed_same_tokens_alone_and_batched(engine):
    job = SampleJob(PROMPT, 3, SamplingParams(max_tokens=8, seed=7, temperature=1.0, top_k=200, top_p=0.95))
    alone = tokens_of(engine.sample([job])[0])
    assert tokens_of(engine.sample([job])[0]) == alone
    assert len(set(map(tuple, alone))) == 3  # the samples of one job differ from each other
    # A neighbour with a longer prompt (so the prompt is padded differently), other
    # parameters and no seed does not change what the seeded job draws.
    neighbour = SampleJob(OTHER, 2, SamplingParams(max_tokens=5, temperature=0.7, top_k=50))
    batched = engine.sample([neighbour, job, neighbour])[1]
    assert tokens_of(batched) == alone
    other_seed = SampleJob(PROMPT, 3, SamplingParams(max_tokens=8, seed=8, temperature=1.0, top_k=200, top_p=0.95))
    assert tokens_of(engine.sample([other_seed])[0]) != alone


def test_unseeded_jobs_use_fresh_entropy(engine):
    job = SampleJob(PROMPT, 2, SamplingParams(max_tokens=6))
    assert tokens_of(engine.sample([job])[0]) != tokens_of(engine.sample([job])[0])


def test_job_larger_than_a_wave_is_split_and_stays_reproducible(tiny_files):
    small = SamplerEngine(tiny_files, max_batch_rows=4)
    job = SampleJob(PROMPT, 10, SamplingParams(max_tokens=3, seed=3), prompt_logprobs=True)
    first, second = small.sample([job]), small.sample([job])
    assert len(first[0].sequences) == 10
    assert tokens_of(first[0]) == tokens_of(second[0])
    assert len(set(map(tuple, tokens_of(first[0])))) == 10
    assert first[0].prompt_logprobs[0] is None and len(first[0].prompt_logprobs) == len(PROMPT)


def chi_square(counts, expected):
    return float(((counts - expected) ** 2 / expected).sum())


def test_first_token_frequencies_match_the_softmax(engine, first_token_probs):
    """Near-uniform random-weight logits: bin the vocabulary into 20 bins of equal mass."""
    jobs = [SampleJob(PROMPT, 1024, SamplingParams(max_tokens=1, seed=s, stop=[])) for s in range(4)]
    drawn = np.array([s.tokens[0] for r in engine.sample(jobs) for s in r.sequences])
    probs = torch.softmax(first_token_probs, dim=-1).numpy()
    order = np.argsort(-probs)
    cumulative = np.cumsum(probs[order])
    bins = 20
    bin_of_token = np.empty(len(probs), dtype=np.int64)
    bin_of_token[order] = np.minimum((cumulative - probs[order] / 2) * bins, bins - 1).astype(np.int64)
    bin_mass = np.bincount(bin_of_token, weights=probs, minlength=bins)
    counts = np.bincount(bin_of_token[drawn], minlength=bins)
    assert chi_square(counts, len(drawn) * bin_mass) < CHI2_20_DOF_P1E4
    # The same draws against a uniform sampler's expectation: the test has the power to
    # tell the two apart.
    uniform_mass = np.bincount(bin_of_token, minlength=bins) / len(probs)
    assert chi_square(counts, len(drawn) * uniform_mass) > 3 * CHI2_20_DOF_P1E4


def test_top_k_and_temperature_on_the_model(engine, first_token_probs):
    """top_k=5: only the five best tokens; temperature 0.02 sharpens their softmax."""
    jobs = [SampleJob(PROMPT, 1000, SamplingParams(max_tokens=1, seed=s, top_k=5, temperature=0.02)) for s in (1, 2)]
    drawn = np.array([s.tokens[0] for r in engine.sample(jobs) for s in r.sequences])
    top_logits, top_ids = torch.topk(first_token_probs, 5)
    assert set(drawn.tolist()) <= set(top_ids.tolist())
    probs = torch.softmax(top_logits / 0.02, dim=-1).numpy()
    assert probs.max() < 0.8  # sharpened but still spread, so the check sees the shape
    counts = np.array([(drawn == t).sum() for t in top_ids.tolist()])
    assert chi_square(counts, len(drawn) * probs) < CHI2_4_DOF_P1E4
