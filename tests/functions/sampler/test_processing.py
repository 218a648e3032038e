"""Logits processing on hand-built logits, against plain-Python / float64 numpy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from functions.sampler import processing

NEG_INF = float("-inf")


def rows(*values):
    return torch.tensor(values, dtype=torch.float32)


def params(n, temperature=1.0, top_k=-1, top_p=1.0):
    return (
        torch.full((n,), temperature, dtype=torch.float32),
        torch.full((n,), top_k, dtype=torch.long),
        torch.full((n,), top_p, dtype=torch.float32),
    )


def kept(filtered_R_V):
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in filtered_R_V]


def reference_nucleus(probs, p):
    """Smallest set, by decreasing probability, whose mass reaches p (plain loop)."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    chosen, mass = set(), 0.0
    for i in order:
        if mass >= p:
            break
        chosen.add(i)
        mass += probs[i]
    return chosen


def test_token_logprobs_match_float64_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 1000) * 4
    tokens = torch.randint(0, 1000, (5,))
    got = processing.token_logprobs(logits, tokens)
    x = logits.double().numpy()
    ref = x[np.arange(5), tokens.numpy()] - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) - x.max(1)
    np.testing.assert_allclose(got.numpy(), ref, atol=1e-5)


def test_no_filter_only_scales_by_temperature():
    logits = rows([1.0, 2.0, 3.0], [0.0, -1.0, 4.0])
    out = processing.filter_logits(logits, torch.tensor([0.5, 2.0]), torch.tensor([-1, -1]), torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(out, rows([2.0, 4.0, 6.0], [0.0, -0.5, 2.0]))


def test_top_k_keeps_the_k_largest_per_row():
    logits = rows([0.1, 5.0, 3.0, 4.0, -2.0], [9.0, 1.0, 2.0, 3.0, 4.0])
    out = processing.filter_logits(logits, torch.ones(2), torch.tensor([2, 3]), torch.ones(2))
    assert kept(out) == [{1, 3}, {0, 3, 4}]
    # Survivors keep their scaled value; top_k >= vocab or -1 means no limit.
    assert out[0, 1] == 5.0
    out = processing.filter_logits(logits, torch.ones(2), torch.tensor([5, 99]), torch.ones(2))
    assert kept(out) == [set(range(5))] * 2


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = rows([1.0, 3.0, 2.0, 2.0, 0.0])
    out = processing.filter_logits(logits, torch.ones(1), torch.tensor([2]), torch.ones(1))
    assert kept(out) == [{1, 2, 3}]


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.6, 0.61, 0.8, 0.95, 0.999])
def test_top_p_keeps_the_smallest_set_reaching_p(p):
    probs = [0.05, 0.5, 0.1, 0.25, 0.1 - 1e-3, 1e-3]  # distinct values: no ties
    logits = torch.log(torch.tensor([probs], dtype=torch.float32))
    out = processing.filter_logits(logits, torch.ones(1), torch.tensor([-1]), torch.tensor([p]))
    assert kept(out) == [reference_nucleus(probs, p)]


def test_top_p_boundary_exactly_reached():
    # Mass of the top two is exactly 0.75 (exact in binary): p = 0.75 needs only those two.
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    out = processing.filter_logits(logits, torch.ones(1), torch.tensor([-1]), torch.tensor([0.75]))
    assert kept(out) == [{0, 1}]


def test_top_p_keeps_all_tokens_tied_with_the_last_needed_one():
    # 0.4 alone is short of p = 0.5; the next needed token ties with another, both stay.
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    out = processing.filter_logits(logits, torch.ones(1), torch.tensor([-1]), torch.tensor([0.5]))
    assert kept(out) == [{0, 1, 2, 3}]


def test_top_p_applies_to_the_renormalised_top_k_and_after_temperature():
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    logits = torch.tensor(np.log(probs)[None], dtype=torch.float32)
    # top_k = 2 renormalises to [4/7, 3/7]; p = 0.5 then keeps one token, p = 0.6 both.
    out = processing.filter_logits(logits, torch.ones(1), torch.tensor([2]), torch.tensor([0.5]))
    assert kept(out) == [{0}]
    out = processing.filter_logits(logits, torch.ones(1), torch.tensor([2]), torch.tensor([0.6]))
    assert kept(out) == [{0, 1}]
    # Temperature 0.25 sharpens to p^4 / sum: [0.7529, 0.2382, 0.0471, 0.0029].
    sharp = probs**4 / (probs**4).sum()
    out = processing.filter_logits(logits, torch.tensor([0.25]), torch.tensor([-1]), torch.tensor([0.95]))
    assert kept(out) == [reference_nucleus(list(sharp), 0.95)] == [{0, 1}]


def test_rows_with_different_parameters_are_independent():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 3))
    out = processing.filter_logits(logits, torch.ones(3), torch.tensor([-1, 1, -1]), torch.tensor([1.0, 1.0, 0.65]))
    assert kept(out) == [{0, 1, 2, 3}, {0}, {0, 1}]


def test_inverse_cdf_maps_uniforms_to_intervals():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 6))
    uniform = torch.tensor([0.0, 0.05, 0.15, 0.35, 0.65, 0.999999], dtype=torch.float64)
    tokens = processing.sample_from_filtered(logits, uniform)
    assert tokens.tolist() == [0, 0, 1, 2, 3, 3]


def test_cut_tokens_are_never_drawn_even_at_the_extremes():
    filtered = torch.tensor([[NEG_INF, 0.0, NEG_INF, 0.0, NEG_INF]] * 3)
    uniform = torch.tensor([0.0, 0.5, math.nextafter(1.0, 0.0)], dtype=torch.float64)
    assert processing.sample_from_filtered(filtered, uniform).tolist() == [1, 3, 3]


def test_greedy_rows_take_the_argmax_and_ignore_their_uniform():
    logits = rows([0.0, 2.0, 1.0], [3.0, 0.0, 1.0])
    temperature, top_k, top_p = params(2, temperature=0.0)
    temperature[1] = 1.0
    tokens = processing.next_tokens(logits, temperature, top_k, top_p, torch.tensor([0.99, 0.999]))
    assert tokens.tolist() == [1, 2]


def test_empirical_frequencies_match_the_filtered_softmax():
    """Chi-square of 20,000 draws against the float64 softmax of the scaled, cut logits."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    n = 20_000
    generator = torch.Generator().manual_seed(1234)
    cases = [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.0, 3, 1.0), (1.3, -1, 0.8), (1.0, 5, 0.9)]
    for temperature, top_k, top_p in cases:
        t, k, p = params(n, temperature, top_k, top_p)
        uniform = torch.rand(n, generator=generator, dtype=torch.float64)
        tokens = processing.next_tokens(logits.expand(n, -1), t, k, p, uniform)
        counts = np.bincount(tokens.numpy(), minlength=8)
        # Independent reference: explicit float64 softmax, loop-based cuts.
        scaled = logits[0].double().numpy() / temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        allowed = set(np.argsort(-probs)[: (top_k if top_k > 0 else 8)])
        probs = np.where([i in allowed for i in range(8)], probs, 0.0)
        probs /= probs.sum()
        allowed &= reference_nucleus(list(probs), top_p)
        probs = np.where([i in allowed for i in range(8)], probs, 0.0)
        probs /= probs.sum()
        assert all(counts[i] == 0 for i in range(8) if probs[i] == 0)
        support = probs > 0
        expected = n * probs[support]
        chi2 = float((((counts[support] - expected) ** 2) / expected).sum())
        assert chi2 < 30.0, (temperature, top_k, top_p, counts, expected)  # p < 1e-4 at <= 7 dof


@pytest.mark.parametrize("vocab", [1000, 1024, 151936])
def test_two_level_draw_equals_a_full_float64_inverse_cdf(vocab):
    """Against numpy's searchsorted on one float64 cumsum (padded and unpadded blocks)."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=generator) * 3
    logits[:, ::7] = NEG_INF  # cut tokens interleaved with kept ones
    uniform = torch.rand(4, generator=generator, dtype=torch.float64)
    uniform = torch.cat([uniform, uniform.new_tensor([0.0, 0.5, 0.999])])
    logits = torch.cat([logits, logits[:3]])
    tokens = processing.sample_from_filtered(logits, uniform).tolist()
    for row, u, token in zip(logits.double().numpy(), uniform.numpy(), tokens):
        probs = np.exp(row - row.max())
        cdf = np.cumsum(probs / probs.sum())
        expected = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        assert token == expected and np.isfinite(row[token])


@pytest.mark.parametrize("scale", [0.05, 3.0])
def test_top_p_on_a_large_vocabulary_peaked_or_flat(scale):
    """The candidate window (all but a full sort when peaked) finds the same nucleus."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 5000, generator=generator) * scale
    top_p = torch.tensor([0.5, 0.9, 0.99])
    out = processing.filter_logits(logits, torch.ones(3), torch.full((3,), -1), top_p)
    for row, p, got in zip(logits.double(), top_p.tolist(), kept(out)):
        probs = torch.softmax(row, dim=0).tolist()
        assert got == reference_nucleus(probs, p)
