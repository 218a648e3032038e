"""Batch validation: each malformed batch is refused with a message that names the problem."""

import numpy as np
import pytest

from openrl_core.datum import Datum, DatumRecord, validate_batch
from openrl_core.errors import InvalidRequest
from openrl_core.losses import resolve_config

VOCAB = 100


def ce(tokens, targets=None, weights=None, **extra):
    tokens = np.asarray(tokens, dtype=np.int64)
    inputs = {"target_tokens": np.asarray(targets if targets is not None else tokens, dtype=np.int64)}
    if weights is not None:
        inputs["weights"] = np.asarray(weights, dtype=np.float32)
    inputs.update({k: np.asarray(v, dtype=np.float32) for k, v in extra.items()})
    return Datum(tokens, inputs)


def test_a_good_batch_passes_and_round_trips_through_an_event():
    batch = [ce([1, 2, 3], [2, 3, 4], [0, 1, 1]), ce([5, 6], [6, 7], [1, -0.5])]
    assert validate_batch(batch, "cross_entropy", VOCAB).name == "cross_entropy"
    back = [DatumRecord.from_datum(d).to_datum() for d in batch]
    for a, b in zip(batch, back):
        assert np.array_equal(a.tokens_N, b.tokens_N)
        assert all(np.array_equal(a.loss_fn_inputs[k], b.loss_fn_inputs[k]) for k in a.loss_fn_inputs)


@pytest.mark.parametrize(
    "batch,loss,message",
    [
        ([], "cross_entropy", "at least one datum"),
        ([ce([1, 2], [2, 3], [1, 1])], "mse", "unknown loss_fn"),
        ([ce([1, 200], [2, 3], [1, 1])], "cross_entropy", "token id 200"),
        ([ce([1, 2], [2, -1], [1, 1])], "cross_entropy", "token id -1"),
        ([ce([1, 2], [2, 3, 4], [1, 1, 1])], "cross_entropy", "first dimension must equal"),
        ([ce([1, 2], [2, 3], [1, 1, 1])], "cross_entropy", "must match target_tokens"),
        ([ce([1, 2], [2, 3], [1, float("nan")])], "cross_entropy", "NaN"),
        ([ce([1, 2], [2, 3])], "importance_sampling", "lacks"),
        ([ce([1, 2], [2, 3], bogus=[0, 0])], "cross_entropy", "unknown keys"),
        ([ce([], [], [])], "cross_entropy", "at least one token"),
    ],
)
def test_bad_batches_are_refused_with_a_reason(batch, loss, message):
    with pytest.raises(InvalidRequest, match=message):
        validate_batch(batch, loss, VOCAB)


def test_context_limit():
    with pytest.raises(InvalidRequest, match="context"):
        validate_batch([ce(list(range(10)))], "cross_entropy", VOCAB, max_length=8)


def test_loss_config_defaults_and_overrides():
    assert resolve_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_config("ppo", {"clip_high_threshold": 1.5})["clip_high_threshold"] == 1.5
    assert resolve_config("cross_entropy", {}) == {}
    with pytest.raises(InvalidRequest, match="not used"):
        resolve_config("cross_entropy", {"beta": 0.1})
    with pytest.raises(InvalidRequest, match="finite number"):
        resolve_config("ppo", {"clip_low_threshold": "low"})
