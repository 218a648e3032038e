"""The loss catalogue's contract: config defaults, refused keys, and named refusals."""

from __future__ import annotations

import pytest

from openrl_core.errors import InvalidRequest
from openrl_core.losses import LOSSES, UNSUPPORTED, loss_spec, resolve_config


def test_defaults_are_overlaid_by_the_request():
    assert resolve_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_config("ppo", {"clip_high_threshold": 1.5}) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.5,
    }
    assert resolve_config("cispo", {}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert resolve_config("cross_entropy", None) == {}


@pytest.mark.parametrize("loss_fn, config, message", [
    ("ppo", {"beta": 0.1}, "not used by 'ppo'"),
    ("cross_entropy", {"beta": 0.1}, "allowed keys: none"),
    ("dro", {"beta": "high"}, "must be a finite number"),
    ("dro", {"beta": float("nan")}, "must be a finite number"),
])  # fmt: skip
def test_bad_config_is_refused(loss_fn, config, message):
    with pytest.raises(InvalidRequest, match=message):
        resolve_config(loss_fn, config)


def test_stable_reinforce_is_served_and_custom_is_refused_with_its_reason_not_as_unknown():
    assert not set(UNSUPPORTED) & set(LOSSES)
    spec = loss_spec("stable_reinforce")
    assert spec.required == ("target_tokens", "advantages")
    assert resolve_config("stable_reinforce", {"kl_coeff": 0.01}) == {"clip_high_threshold": 2.0, "kl_coeff": 0.01}
    with pytest.raises(InvalidRequest, match="forward_backward_custom"):
        loss_spec("custom")
    with pytest.raises(InvalidRequest, match="unknown loss_fn 'mse'"):
        loss_spec("mse")
