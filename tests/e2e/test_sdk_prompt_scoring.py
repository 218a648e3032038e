"""SDK 0.38's scoring fields through the real SDK against a real `openrl serve` (torch engine):
`target_prompt_logprobs` dense and sparse CSR, `prompt_alt_tokens_k`, `topk_sample_logprobs`,
each against a plain forward of the tiny model computed here, plus the 400s a bad request gets."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.e2e.sdk_close import close_service

pytestmark = pytest.mark.e2e
MODEL = "openrl/tiny-qwen3"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference_logprobs(tiny_files):
    from functions.compute.models import load_causal_lm

    model = load_causal_lm(tiny_files).eval()

    def logprobs_T_V(tokens):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), dim=-1)

    return logprobs_T_V


def test_scoring_fields_match_a_plain_forward(sdk_env, tiny_files, reference_logprobs):
    service = tinker.ServiceClient()
    sampler = service.create_sampling_client(base_model=MODEL).result()
    from functions.compute.models import load_tokenizer

    tokens = load_tokenizer(tiny_files).encode("the quick brown fox jumps over the lazy dog")
    prompt = types.ModelInput.from_ints(tokens)
    rows = len(tokens) - 1
    want_T_V = reference_logprobs(tokens)[:-1]  # row i: position i + 1

    # dense and sparse target ids: the same ids, answered in the layout asked
    rng = np.random.default_rng(4)
    ids_R_K = torch.tensor(rng.integers(0, tiny_files.vocab_size, size=(rows, 4)))
    ids_R_K[torch.tensor(rng.random((rows, 4)) < 0.7)] = -1
    ids_R_K[:2] = -1
    ids_R_K[2, 1] = tokens[3]
    want_R_K = want_T_V.gather(1, ids_R_K.clamp(min=0)).float()
    want_R_K[ids_R_K == -1] = 0.0
    params = types.SamplingParams(max_tokens=1, temperature=0)
    dense = sampler.sample(
        prompt, 1, params, include_prompt_logprobs=True, target_prompt_logprobs=types.TensorData.from_torch(ids_R_K)
    ).result()
    assert dense.target_prompt_logprobs.sparse_crow_indices is None
    np.testing.assert_allclose(dense.target_prompt_logprobs.to_numpy(), want_R_K.numpy(), atol=TOLERANCE)
    np.testing.assert_allclose(dense.prompt_logprobs[1:], want_T_V.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0],
                               atol=TOLERANCE)  # fmt: skip
    sparse_ids = types.TensorData.from_torch_sparse(ids_R_K, pad_value=-1)
    assert sparse_ids.sparse_crow_indices is not None  # mostly -1: sent as CSR
    sparse = sampler.sample(prompt, 1, params, target_prompt_logprobs=sparse_ids).result()
    answer = sparse.target_prompt_logprobs
    assert (answer.sparse_crow_indices, answer.sparse_col_indices) == (
        list(sparse_ids.sparse_crow_indices),
        list(sparse_ids.sparse_col_indices),
    )
    np.testing.assert_allclose(answer.to_numpy(), want_R_K.numpy(), atol=TOLERANCE)

    # alt tokens: at temperature 0 the argmax k times; at temperature 1 draws whose logprobs are raw
    greedy = sampler.sample(prompt, 1, params, prompt_alt_tokens_k=3).result().prompt_alt_tokens
    assert greedy.tokens.shape == greedy.logprobs.shape == [rows, 3]
    assert (greedy.tokens.to_numpy() == want_T_V.argmax(-1).numpy()[:, None]).all()
    drawn = (
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1, temperature=1.0, seed=2), prompt_alt_tokens_k=5)
        .result()
        .prompt_alt_tokens
    )
    drawn_R_k = torch.tensor(drawn.tokens.to_numpy())
    np.testing.assert_allclose(drawn.logprobs.to_numpy(), want_T_V.gather(1, drawn_R_k).numpy(), atol=TOLERANCE)
    assert len(set(drawn_R_k.flatten().tolist())) > 5  # near-uniform random weights: really drawn

    # top-k at each sampled position, and the sampled tokens unchanged by asking for it
    sample_params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=8, stop=[])
    with_topk = sampler.sample(prompt, 2, sample_params, topk_sample_logprobs=4).result()
    plain = sampler.sample(prompt, 2, sample_params).result()
    assert [s.tokens for s in with_topk.sequences] == [s.tokens for s in plain.sequences]
    assert all(s.topk_logprobs is None for s in plain.sequences)
    for sequence in with_topk.sequences:
        full_T_V = reference_logprobs(tokens + sequence.tokens)[len(tokens) - 1 : -1]
        assert len(sequence.topk_logprobs) == len(sequence.tokens)
        for t, pairs in enumerate(sequence.topk_logprobs):
            values, top = torch.topk(full_T_V[t], 4)
            assert [token for token, _ in pairs] == top.tolist()
            np.testing.assert_allclose([lp for _, lp in pairs], values.numpy(), atol=TOLERANCE)

    # bad requests: a 400 that says what is wrong
    with pytest.raises(tinker.BadRequestError, match=r"shape \[\d+, K\]"):
        sampler.sample(prompt, 1, params, target_prompt_logprobs=types.TensorData.from_torch(ids_R_K[1:])).result()
    with pytest.raises(tinker.BadRequestError, match="names no token id"):
        none = torch.full((rows, 1), -1)
        sampler.sample(prompt, 1, params, target_prompt_logprobs=types.TensorData.from_torch(none)).result()
    with pytest.raises(tinker.BadRequestError, match="topk_sample_logprobs must be between 0 and 64"):
        sampler.sample(prompt, 1, params, topk_sample_logprobs=65).result()
    with pytest.raises(tinker.BadRequestError, match="prompt_alt_tokens_k: len"):
        sampler.sample(prompt, 1, params, prompt_alt_tokens_k=10**7).result()
    close_service(service)
