"""Microbatch grouping: budget, padding bound, determinism; and right padding."""

from __future__ import annotations

import numpy as np

from functions.trainer.batching import microbatches, pad_right
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
