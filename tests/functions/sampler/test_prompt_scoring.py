"""SDK 0.38's scoring fields on the torch engine (tiny Qwen3), against plain references: one
full forward of the prompt (or prompt + sample) without cache, its float64 log-softmax.

`target_prompt_logprobs` row i, column j is log p(ids[i, j] at position i + 1); the alt
tokens are draws from softmax(logits / T) at each position after the first, with their raw
logprobs; `topk_sample_logprobs` are the top-k of each sampled position's raw distribution.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functions.compute.models import load_causal_lm
from functions.sampler.engine import SamplerEngine
from functions.sampler.types import SampleJob
from openrl_core.errors import InvalidRequest
from openrl_core.params import SamplingParams
from openrl_core.prompt_targets import TargetIds

PROMPT = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 1549]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_files):
    return SamplerEngine(tiny_files)


@pytest.fixture(scope="module")
def reference(tiny_files):
    model = load_causal_lm(tiny_files).eval()

    def logprobs_T_V(tokens: list[int]) -> torch.Tensor:
        """Row t: log p(next token | tokens[: t + 1]), float64."""
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), dim=-1)

    return logprobs_T_V


def target_ids(rng, rows: int, k: int, vocab: int) -> np.ndarray:
    ids = rng.integers(0, vocab, size=(rows, k))
    ids[rng.random((rows, k)) < 0.4] = -1
    ids[0] = -1  # rows before the first named id are not scored: their answer is 0.0
    ids[3, 0] = PROMPT[4]  # the true next token, among others
    return ids


def test_target_prompt_logprobs_are_the_forward_logprobs_of_each_id(engine, reference, tiny_files):
    rng = np.random.default_rng(0)
    ids_R_K = target_ids(rng, len(PROMPT) - 1, 5, tiny_files.vocab_size)
    job = SampleJob(PROMPT, 1, SamplingParams(max_tokens=2, temperature=0), target_prompt_ids=ids_R_K)
    result = engine.sample([job])[0]
    want_T_V = reference(PROMPT)
    want_R_K = want_T_V[:-1].gather(1, torch.tensor(ids_R_K).clamp(min=0)).numpy()
    want_R_K[ids_R_K == -1] = 0.0
    got_R_K = np.asarray(result.target_prompt_logprobs)
    assert got_R_K.shape == ids_R_K.shape and got_R_K.dtype == np.float32
    np.testing.assert_allclose(got_R_K, want_R_K, atol=TOLERANCE)
    assert (got_R_K[ids_R_K == -1] == 0.0).all() and (got_R_K[ids_R_K != -1] < 0).all()
    assert result.prompt_logprobs is None and result.prompt_alt_tokens is None


def test_sparse_request_is_answered_in_its_own_layout():
    ids = np.full((4, 3), -1)
    ids[1, 2], ids[3, 0], ids[3, 1] = 7, 9, 11
    crow, col, data = [0, 0, 1, 1, 3], [2, 0, 1], [7, 9, 11]
    wire = {"data": data, "dtype": "int64", "shape": [4, 3], "sparse_crow_indices": crow, "sparse_col_indices": col}
    targets = TargetIds.from_wire(wire, 5, 100)
    assert (targets.dense_ids_R_K == ids).all() and targets.first_row == 1 and targets.distinct_ids == 3
    values = np.arange(12, dtype=np.float32).reshape(4, 3) - 20
    answer = targets.answer(values)
    assert answer == {
        "data": [values[1, 2], values[3, 0], values[3, 1]],
        "dtype": "float32",
        "shape": [4, 3],
        "sparse_crow_indices": crow,
        "sparse_col_indices": col,
    }
    dense = TargetIds.from_wire({"data": ids.ravel().tolist(), "dtype": "int64", "shape": [4, 3]}, 5, 100)
    assert dense.answer(values)["data"] == np.where(ids == -1, 0.0, values).ravel().tolist()


@pytest.mark.parametrize(
    "wire, says",
    [
        ({"data": [1, 2], "dtype": "float32", "shape": [2, 1]}, "int64"),
        ({"data": [1, 2], "dtype": "int64", "shape": [2]}, "2-D"),
        ({"data": [1, 2, 3], "dtype": "int64", "shape": [3, 1]}, "shape [2, K]"),
        ({"data": [1], "dtype": "int64", "shape": [2, 1]}, "1 values but shape"),
        ({"data": [-1, -1], "dtype": "int64", "shape": [2, 1]}, "names no token id"),
        ({"data": [5, 100], "dtype": "int64", "shape": [2, 1]}, "outside [0, 100)"),
        ({"data": [-2, 1], "dtype": "int64", "shape": [2, 1]}, "outside [0, 100)"),
        ({"data": [1], "dtype": "int64", "shape": [2, 1], "sparse_crow_indices": [0, 1]}, "both"),
        (
            {
                "data": [1],
                "dtype": "int64",
                "shape": [2, 1],
                "sparse_crow_indices": [0, 2, 1],
                "sparse_col_indices": [0],
            },
            "never decrease",
        ),  # fmt: skip
    ],
)
def test_bad_target_tensors_are_refused_with_the_reason(wire, says):
    with pytest.raises(InvalidRequest, match=says.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        TargetIds.from_wire(wire, 3, 100)


def test_alt_tokens_are_drawn_at_the_temperature_with_their_raw_logprobs(engine, reference):
    k, temperature = 3000, 0.05
    job = SampleJob(PROMPT, 1, SamplingParams(max_tokens=1, temperature=temperature, seed=3), prompt_alt_tokens_k=k)
    tokens_R_k, logprobs_R_k = engine.sample([job])[0].prompt_alt_tokens
    want_T_V = reference(PROMPT)[:-1]
    assert tokens_R_k.shape == logprobs_R_k.shape == (len(PROMPT) - 1, k)
    np.testing.assert_allclose(logprobs_R_k, want_T_V.gather(1, torch.tensor(tokens_R_k)).numpy(), atol=TOLERANCE)
    # the draws follow softmax(logits / T): at every position, the frequencies of the 20 most
    # likely tokens are within a few standard errors of their probabilities
    probs_T_V = torch.softmax(want_T_V / temperature, dim=-1)
    for row in range(len(PROMPT) - 1):
        top = torch.topk(probs_T_V[row], 20).indices
        freq = np.array([(tokens_R_k[row] == int(t)).mean() for t in top])
        p = probs_T_V[row, top].numpy()
        assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / k) + 2 / k), row
    # seeded: the same draws again
    again_R_k, _ = engine.sample([job])[0].prompt_alt_tokens
    assert (again_R_k == tokens_R_k).all()


def test_alt_tokens_at_temperature_zero_are_the_argmax(engine, reference):
    job = SampleJob(PROMPT, 1, SamplingParams(max_tokens=1, temperature=0), prompt_alt_tokens_k=4)
    tokens_R_k, logprobs_R_k = engine.sample([job])[0].prompt_alt_tokens
    want_T_V = reference(PROMPT)[:-1]
    assert (tokens_R_k == want_T_V.argmax(dim=-1).numpy()[:, None]).all()
    np.testing.assert_allclose(logprobs_R_k[:, 0], want_T_V.max(dim=-1).values.numpy(), atol=TOLERANCE)


def test_topk_sample_logprobs_are_the_top_k_of_each_sampled_position(engine, reference):
    k = 5
    job = SampleJob(PROMPT, 3, SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop=[]), topk_sample_logprobs=k)
    for sequence in engine.sample([job])[0].sequences:
        assert len(sequence.topk_logprobs) == len(sequence.tokens) == 6
        full_T_V = reference(PROMPT + sequence.tokens)[len(PROMPT) - 1 : -1]
        for t, pairs in enumerate(sequence.topk_logprobs):
            values, ids = torch.topk(full_T_V[t], k)
            assert [tok for tok, _ in pairs] == ids.tolist()
            np.testing.assert_allclose([lp for _, lp in pairs], values.numpy(), atol=TOLERANCE)
            assert abs(full_T_V[t, sequence.tokens[t]].item() - sequence.logprobs[t]) < TOLERANCE


def test_asking_for_scores_changes_no_sampled_token(engine, tiny_files):
    """The draws have a generator of their own; prefill columns for scoring change nothing."""
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, stop=[])
    plain = engine.sample([SampleJob(PROMPT, 2, params)])[0]
    ids = target_ids(np.random.default_rng(1), len(PROMPT) - 1, 2, tiny_files.vocab_size)
    scored = engine.sample(
        [SampleJob(PROMPT, 2, params, prompt_alt_tokens_k=3, target_prompt_ids=ids, topk_sample_logprobs=2)]
    )[0]
    assert [s.tokens for s in scored.sequences] == [s.tokens for s in plain.sequences]
    # Not bitwise: a scored prefill projects every prompt position through the lm_head in one
    # matmul, whose blocking can differ in the last bit (seen at one thread) from the plain
    # prefill's last-row projection; the draws themselves are bitwise the same.
    for got, want in zip(scored.sequences, plain.sequences):
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-5)
    assert all(s.topk_logprobs is None for s in plain.sequences)


def test_the_engine_refuses_fields_it_cannot_serve(engine):
    params = SamplingParams(max_tokens=1)
    with pytest.raises(InvalidRequest, match="at least 2 tokens"):
        engine.validate(SampleJob([5], 1, params, prompt_alt_tokens_k=1))
    with pytest.raises(InvalidRequest, match=r"shape \[2, K\]"):
        engine.validate(SampleJob([5, 6, 7], 1, params, target_prompt_ids=np.ones((3, 1), dtype=np.int64)))
    with pytest.raises(InvalidRequest, match="topk_sample_logprobs"):
        engine.validate(SampleJob([5, 6], 1, params, topk_sample_logprobs=-1))
