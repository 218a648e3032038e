"""Stop rules on token ids with a toy decoder (one token id -> one fixed piece of text)."""

from __future__ import annotations

import pytest

from functions.sampler.stops import StopRule
from openrl_core.errors import InvalidRequest
from openrl_core.params import SamplingParams

EOS = 99
PIECES = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "\n", 6: "User", 7: ":", 8: "é", EOS: "</s>"}


def decode(tokens):
    return "".join(PIECES[t] for t in tokens)


class CountingDecode:
    def __init__(self):
        self.lengths = []

    def __call__(self, tokens):
        self.lengths.append(len(tokens))
        return decode(tokens)


def first_stop(rule, tokens, decode_fn=decode):
    """Feed tokens one at a time, as the engine does; index of the stopping token or None."""
    for i in range(len(tokens)):
        if rule.is_stop(tokens[: i + 1], decode_fn):
            return i
    return None


def test_default_stops_at_eos_only():
    rule = StopRule.from_params(SamplingParams(), [EOS])
    assert rule.token_ids == {EOS} and rule.strings == ()
    assert first_stop(rule, [1, 2, EOS, 3]) == 2
    assert first_stop(rule, [1, 2, 3]) is None


def test_token_id_stops_add_to_eos():
    rule = StopRule.from_params(SamplingParams(stop=[5, 7]), [EOS])
    assert rule.token_ids == {5, 7, EOS}
    assert first_stop(rule, [1, 2, 7, 5]) == 2


def test_empty_list_never_stops_not_even_at_eos():
    rule = StopRule.from_params(SamplingParams(stop=[]), [EOS])
    assert rule.never_stops
    assert first_stop(rule, [EOS, EOS, 1]) is None


def test_string_stop_ends_at_the_token_completing_it():
    rule = StopRule.from_params(SamplingParams(stop="\nUser:"), [EOS])
    assert rule.token_ids == {EOS}
    # "Hello world\nUser:" completes at the ":" token (index 6), not earlier.
    assert first_stop(rule, [1, 2, 3, 4, 5, 6, 7, 1]) == 6
    assert first_stop(rule, [1, 2, 5, 6, 1, 7]) is None  # "\nUserHel:" never matches


def test_string_spanning_tokens_and_several_strings():
    rule = StopRule.from_params(SamplingParams(stop=["llo w", "zzz"]), [EOS])
    assert first_stop(rule, [1, 2, 3, 4]) == 2  # "Hel" + "lo" + " wor" completes "llo w"


def test_eos_still_stops_when_strings_are_given():
    rule = StopRule.from_params(SamplingParams(stop=["zzz"]), [EOS])
    assert first_stop(rule, [1, EOS]) == 1


def test_only_a_tail_is_decoded():
    rule = StopRule.from_params(SamplingParams(stop=["é!"]), [EOS])
    assert rule.tail_tokens == len("é!".encode()) + 2
    counting = CountingDecode()
    assert first_stop(rule, [1, 2, 3, 4] * 50, counting) is None
    assert max(counting.lengths) == rule.tail_tokens


def test_empty_stop_string_is_rejected():
    with pytest.raises(InvalidRequest):
        StopRule.from_params(SamplingParams(stop=["ok", ""]), [EOS])
