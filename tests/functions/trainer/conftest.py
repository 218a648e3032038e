"""Helpers for the trainer tests: a fresh engine on the tiny Qwen3 and hand-built datums."""

from __future__ import annotations

import numpy as np
import pytest

from openrl_core.datum import Datum


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Run these tests on one intra-op thread, then restore the setting.

    On a busy 2-core machine (CI, or other test runs alongside) torch's two OpenMP threads
    spin-wait for each other: a SmolLM2 step measured 0.25 s on one thread and up to 25 s on
    two. One thread keeps the suite's time predictable; the numbers do not depend on it.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def engine(tiny_files):
    """A fresh engine per test (loading the tiny model takes well under a second)."""
    from functions.trainer.engine import TrainerEngine

    return TrainerEngine(tiny_files)


def sft_datum(rng: np.random.Generator, length: int, vocab: int = 2000, weights: np.ndarray | None = None) -> Datum:
    tokens = rng.integers(0, vocab, size=length + 1).astype(np.int64)
    if weights is None:
        weights = np.ones(length, dtype=np.float32)
    return Datum(tokens[:-1], {"target_tokens": tokens[1:].copy(), "weights": weights.astype(np.float32)})


def sft_batch(seed: int, lengths: list[int]) -> list[Datum]:
    rng = np.random.default_rng(seed)
    return [sft_datum(rng, n) for n in lengths]
