"""Pass planning: buckets, units, at most one unit per model per pass, each model's order kept."""

from __future__ import annotations

import random

import pytest

from openrl_core.packing import PAD_MULTIPLE, Unit, bucket, plan, units


@pytest.mark.parametrize("length, expected", [(1, 16), (16, 16), (17, 32), (32, 32), (100, 112), (128, 128)])
def test_buckets(length, expected):
    assert bucket(length) == expected and expected % PAD_MULTIPLE == 0


def test_units_group_by_bucket_and_split_by_tokens():
    got = units(0, [30, 5, 31, 100, 7, 20], max_tokens=64)
    assert got == [Unit(0, 16, (1, 4)), Unit(0, 32, (0, 2)), Unit(0, 32, (5,)), Unit(0, 112, (3,))]


def test_small_requests_of_many_models_share_passes():
    passes = plan([[32, 32]] * 8, max_tokens=1024, max_rows=64)
    assert len(passes) == 1 and [u.request for u in passes[0]] == list(range(8))


def test_big_units_share_no_pass_beyond_the_shared_bound():
    """8 models x 8 x 128 tokens: each unit (1,024 tokens) alone is fine, two together are over
    the shared bound, so every model runs in a pass of its own; small ones still share."""
    big = plan([[128] * 8] * 8, max_tokens=8192, max_rows=256, max_shared_tokens=1536)
    assert [len(p) for p in big] == [1] * 8 and all(p[0].tokens == 1024 for p in big)
    small = plan([[32, 32]] * 8, max_tokens=8192, max_rows=256, max_shared_tokens=1536)
    assert [len(p) for p in small] == [8]
    assert plan([[32, 32]] * 8, 8192, 256, max_shared_tokens=256) == [
        list(p) for p in plan([[32, 32]] * 8, 256, 256)
    ]  # the shared bound acts like a token bound on shared passes


def test_a_pass_never_holds_two_units_of_one_model():
    passes = plan([[16] * 10, [16]], max_tokens=64, max_rows=100)
    for members in passes:
        assert len({u.request for u in members}) == len(members)
    assert [len(p) for p in passes] == [1, 1, 2]  # the first two are full (4 rows x 16 = 64 tokens)


def test_two_requests_of_one_model_run_one_after_the_other():
    passes = plan([[16, 40], [16], [20]], max_tokens=1024, max_rows=64, models=["a", "b", "a"])
    where = {(u.request, u.bucket): i for i, members in enumerate(passes) for u in members}
    assert where[(0, 16)] < where[(0, 48)] < where[(2, 32)]
    assert where[(0, 16)] == where[(1, 16)]  # b shares a's first pass


def test_random_plans_keep_every_invariant():
    rng = random.Random(3)
    for _ in range(200):
        requests = [[rng.randint(1, 200) for _ in range(rng.randint(1, 9))] for _ in range(rng.randint(1, 8))]
        max_tokens, max_rows = rng.choice([64, 256, 1024, 4096]), rng.choice([2, 8, 64])
        shared = rng.choice([None, 16, 128, 512])
        models = [rng.choice("abc") for _ in requests]
        passes = plan(requests, max_tokens, max_rows, models, max_shared_tokens=shared)
        seen = {i: [] for i in range(len(requests))}
        for position, members in enumerate(passes):
            assert len({u.bucket for u in members}) == 1
            assert len({models[u.request] for u in members}) == len(members)
            if len(members) > 1:
                assert sum(u.tokens for u in members) <= min(max_tokens, shared or max_tokens)
                assert sum(len(u.datums) for u in members) <= max_rows
            for u in members:
                seen[u.request].append((position, u))
        for index, lengths in enumerate(requests):
            # every datum exactly once, and the request's units in the order it would run them alone
            assert [u for _, u in seen[index]] == units(index, lengths, max_tokens)
        for model in "abc":  # a model's requests one after the other, each in its own order
            order = [p for i in range(len(requests)) if models[i] == model for p, _ in seen[i]]
            assert order == sorted(order) and len(set(order)) == len(order)
