"""`openrl_core.stability.resolve`: provenance checked against records, arrays built from them.

The datums are shaped as the cookbook builds them (`rl_loop.with_sampled_provenance` and
`rl.data_processing.trajectory_to_data`): input = prompt + sampled[:-1], targets shifted by
one, prompt target rows padded (rl_loop) or real (data_processing), advantage 0 on them.
"""

from __future__ import annotations

import numpy as np
import pytest

from openrl_core.errors import InvalidRequest
from openrl_core.stability import (
    STABILITY_LOGPROBS,
    STABILITY_MASK,
    Provenance,
    Span,
    StabilityRecord,
    record_from_result,
    record_payload,
    resolve,
    split_sequence_id,
)

PROMPT = (11, 12, 13, 14)
SAMPLED = (21, 22, 23)
SAMPLING_LPS = (-0.5, -1.25, -2.0)
RECORDS = {"req-1:0": StabilityRecord(PROMPT, SAMPLED, SAMPLING_LPS)}


def datum(pad_prompt_targets=True, advantage=1.5):
    tokens = np.asarray(PROMPT + SAMPLED[:-1], dtype=np.int64)
    ob = len(PROMPT) - 1
    targets = ([0] * ob if pad_prompt_targets else list(PROMPT[1:])) + list(SAMPLED)
    inputs = {
        "target_tokens": np.asarray(targets, dtype=np.int64),
        "advantages": np.asarray([0.0] * ob + [advantage] * len(SAMPLED), dtype=np.float32),
    }
    provenance = Provenance(
        model_input=(Span("prompt", "req-1:0", 0, len(PROMPT)), Span("sampled", "req-1:0", 0, len(SAMPLED) - 1)),
        targets=(Span("prompt", "req-1:0", 1, ob), Span("sampled", "req-1:0", 0, len(SAMPLED))),
    )
    return tokens, inputs, provenance


@pytest.mark.parametrize("pad", [True, False])
def test_the_arrays_carry_the_recorded_sampling_logprobs_on_sampled_rows_only(pad):
    tokens, inputs, provenance = datum(pad)
    arrays = resolve("data[0]", tokens, inputs, provenance, RECORDS)
    np.testing.assert_array_equal(arrays[STABILITY_MASK], [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(arrays[STABILITY_LOGPROBS], np.asarray([0, 0, 0, *SAMPLING_LPS], dtype=np.float32))
    assert arrays[STABILITY_LOGPROBS].dtype == np.float32


def test_a_run_of_a_record_offset_reads_the_matching_slice():
    record = {"s:0": StabilityRecord((1, 2), (5, 6, 7, 8), (-1.0, -2.0, -3.0, -4.0))}
    provenance = Provenance((Span("sampled", "s:0", 1, 2),), (Span("sampled", "s:0", 2, 2),))
    inputs = {"target_tokens": np.asarray([7, 8]), "advantages": np.ones(2, dtype=np.float32)}
    arrays = resolve("d", np.asarray([6, 7]), inputs, provenance, record)
    np.testing.assert_array_equal(arrays[STABILITY_LOGPROBS], [-3.0, -4.0])


def _refused(match, tokens, inputs, provenance, records=RECORDS):
    with pytest.raises(InvalidRequest, match=match):
        resolve("data[0]", tokens, inputs, provenance, records)


def test_what_does_not_match_the_record_is_refused():
    tokens, inputs, provenance = datum()
    _refused("no provenance spans", tokens, inputs, None)
    _refused("holds \\['stability_mask'\\]", tokens, {**inputs, STABILITY_MASK: np.ones(6)}, provenance)
    wrong = tokens.copy()
    wrong[5] = 99
    _refused("model_input holds token 99 where sequence 'req-1:0' has 22", wrong, inputs, provenance)
    bad_targets = dict(inputs, target_tokens=inputs["target_tokens"].copy())
    bad_targets["target_tokens"][4] = 7
    _refused("target_tokens holds token 7 where .* has 22 \\(sampled position 1\\)", tokens, bad_targets, provenance)
    advantage_on_prompt = dict(inputs, advantages=inputs["advantages"].copy())
    advantage_on_prompt["advantages"][1] = 0.5
    _refused("non-zero at row 1, which no sampled provenance span backs", tokens, advantage_on_prompt, provenance)
    past_end = Provenance(provenance.model_input, (Span("prompt", "req-1:0", 1, 2), Span("sampled", "req-1:0", 0, 4)))
    _refused("claims sampled positions \\[0, 4\\) .* which has 3 sampled tokens", tokens, inputs, past_end)
    short = Provenance(provenance.model_input[:1], provenance.targets)
    _refused("model_input_spans cover 4 positions but the datum has 6", tokens, inputs, short)


def test_records_round_trip_through_a_completion_result():
    result = {
        "sequences": [{"tokens": list(SAMPLED), "logprobs": [-9.0] * 3, "stop_reason": "stop"}],
        "stability": record_payload(list(PROMPT), [(list(SAMPLED), list(SAMPLING_LPS))]),
    }
    assert record_from_result(result, 0) == RECORDS["req-1:0"]
    assert record_from_result(result, 1) is None
    assert record_from_result({"sequences": result["sequences"]}, 0) is None  # sampled without records
    assert split_sequence_id("abc:def:3") == ("abc:def", 3)
    assert split_sequence_id("nocolon") is None and split_sequence_id("x:y") is None
