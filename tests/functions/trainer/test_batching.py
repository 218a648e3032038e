"""Microbatch grouping: budget, padding bound, determinism; right padding; gathered logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from functions.trainer.batching import gathered_logprobs, microbatches, pad_right
from openrl_core.datum import Datum


def _batch(lengths: list[int]) -> list[Datum]:
    return [Datum(np.arange(n, dtype=np.int64), {"target_tokens": np.arange(n, dtype=np.int64)}) for n in lengths]


def test_groups_similar_lengths_within_the_padding_bound():
    batch = _batch([10, 40, 11, 39, 10, 100])
    assert microbatches(batch, max_padded_tokens=10_000, max_padding=0.1) == [[0, 4, 2], [3, 1], [5]]


def test_budget_splits_groups_and_a_long_datum_stands_alone():
    batch = _batch([8, 8, 8, 8, 30])
    assert microbatches(batch, max_padded_tokens=16, max_padding=0.0) == [[0, 1], [2, 3], [4]]


def test_unbounded_padding_makes_one_group_and_every_index_appears_once():
    batch = _batch([5, 3, 9, 1])
    groups = microbatches(batch, max_padded_tokens=10_000, max_padding=float("inf"))
    assert groups == [[3, 1, 0, 2]]
    assert sorted(i for g in microbatches(batch, 1, 0.0) for i in g) == [0, 1, 2, 3]


def test_pad_right_masks_the_tail():
    tokens, mask = pad_right(_batch([2, 4]), "cpu")
    assert tokens.tolist() == [[0, 1, 0, 0], [0, 1, 2, 3]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


# -- gathered_logprobs: its hand-written backward against autograd's own ---------------------


def _autograd_reference(logits, targets):
    """log_softmax at the targets with autograd's own graph (logsumexp and gather backwards)."""
    return logits.gather(-1, targets) - torch.logsumexp(logits, dim=-1, keepdim=True)


@pytest.mark.parametrize("width", [1, 3])
def test_gathered_logprobs_forward_and_gradient_are_bitwise_autograds(width):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(19, 1000, generator=generator) * 4
    targets = torch.randint(0, 1000, (19, width), generator=generator)
    targets[0, :] = 7  # a repeated target: its gradients add
    upstream = torch.randn(19, width, generator=generator)

    mine_in = logits.clone().requires_grad_(True)
    mine = gathered_logprobs(mine_in * 1.0, targets)  # `* 1.0`: the function may reuse its input's memory
    mine.backward(upstream)
    ref_in = logits.clone().requires_grad_(True)
    ref = _autograd_reference(ref_in * 1.0, targets)
    ref.backward(upstream)
    assert torch.equal(mine, ref)
    assert torch.equal(mine_in.grad, ref_in.grad)


def test_gathered_logprobs_match_a_float64_numpy_reference():
    """Values and gradient against the closed form, computed apart in numpy float64:
    d(logit[t] - logsumexp) / dlogits = onehot(t) - softmax."""
    rng = np.random.default_rng(1)
    logits_np = rng.normal(size=(6, 50)) * 3
    targets_np = rng.integers(0, 50, size=(6, 2))
    upstream_np = rng.normal(size=(6, 2))
    logits = torch.tensor(logits_np, dtype=torch.float32, requires_grad=True)
    out = gathered_logprobs(logits * 1.0, torch.from_numpy(targets_np))
    out.backward(torch.tensor(upstream_np, dtype=torch.float32))

    shifted = logits_np - logits_np.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(6)[:, None]
    np.testing.assert_allclose(out.detach().numpy(), log_softmax[rows, targets_np], rtol=0, atol=1e-5)
    expected = -np.exp(log_softmax) * upstream_np.sum(axis=1, keepdims=True)
    np.add.at(expected, (np.repeat(rows, 2, axis=1), targets_np), upstream_np)
    np.testing.assert_allclose(logits.grad.numpy(), expected, rtol=0, atol=1e-5)


def test_a_second_backward_through_consumed_logits_is_refused():
    logits = torch.randn(4, 10, requires_grad=True)
    out = gathered_logprobs(logits * 1.0, torch.zeros(4, 1, dtype=torch.long)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="consumed"):
        out.backward()
