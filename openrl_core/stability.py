"""StableReinforce's per-sequence stability records and the provenance that names them.

A sample taken with `record_stability_info=true` keeps, per sampled sequence, a record of
what the sampler saw and did (`StabilityRecord`): the request's prompt, the sampled tokens,
and for each sampled token the log-probability of the distribution it was actually drawn
from (`sampling_logprobs`: after temperature, top-k and top-p; 0 for a greedy draw). The
record lives in the sample's completion event (the event store), never only in a worker.

A `stable_reinforce` training datum names its records through its provenance spans
(`tinker.types.Datum.with_provenance`): runs that tile the model input and the target rows,
each run claiming "these positions are positions [offset, offset + length) of sequence S's
prompt / sampled tokens". `resolve` checks every claim against the records and turns them
into two dense per-row arrays the trainer's loss reads (`STABILITY_INPUTS`):

- `stability_logprobs` [N]: the recorded sampling logprob of the target at each row backed
  by a sampled run, 0 elsewhere;
- `stability_mask` [N]: 1 at those rows, 0 elsewhere.

Invariants: a claim that does not match its record (a token that differs, a run past the
end of the record) is refused, naming the datum and the run; a non-zero advantage on a row
that no sampled run backs is refused (StableReinforce trains on sampled tokens only, and
only they have a record); the two arrays are the only way the server's records reach the
loss, and a client may not send them itself. Prompt rows of the targets are not compared
with the record: the cookbook's `rl_loop` pads them with 0 (they carry zero advantage).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Mapping, Optional

import numpy as np

from openrl_core.errors import InvalidRequest

STABILITY_LOGPROBS = "stability_logprobs"
STABILITY_MASK = "stability_mask"
STABILITY_INPUTS = (STABILITY_LOGPROBS, STABILITY_MASK)
# Tinker's documented lifetime of a record: trainable for one day after sampling.
RECORD_TTL = timedelta(days=1)

SpanKind = Literal["prompt", "sampled"]


@dataclass(frozen=True)
class Span:
    """One provenance run: `length` positions that are [offset, offset + length) of the
    named sequence's prompt (`prompt`) or sampled tokens (`sampled`)."""

    kind: SpanKind
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class Provenance:
    """A datum's two span lists: `model_input` tiles its input tokens, `targets` its rows."""

    model_input: tuple[Span, ...]
    targets: tuple[Span, ...]

    def sequence_ids(self) -> set[str]:
        return {span.sequence_id for span in (*self.model_input, *self.targets)}


@dataclass(frozen=True)
class StabilityRecord:
    """What a sampler recorded for one sequence (see the module docstring)."""

    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    sampling_logprobs: tuple[float, ...]


def record_payload(prompt_tokens: list[int], sequences: list[tuple[list[int], list[float]]]) -> dict:
    """The `stability` entry of a sample's completion result: the prompt once, and per
    sequence its sampling logprobs (its tokens are the result's own `sequences[i].tokens`)."""
    return {
        "prompt_tokens": list(prompt_tokens),
        "sampling_logprobs": [[float(x) for x in logprobs] for _tokens, logprobs in sequences],
    }


def record_from_result(result: Mapping, index: int) -> Optional[StabilityRecord]:
    """Sequence `index`'s record from a completed sample's result; None when the sample
    kept none (it was taken without record_stability_info) or has no such sequence."""
    stability = result.get("stability")
    sequences = result.get("sequences") or []
    if not stability or not 0 <= index < len(sequences):
        return None
    return StabilityRecord(
        prompt_tokens=tuple(stability["prompt_tokens"]),
        tokens=tuple(sequences[index]["tokens"]),
        sampling_logprobs=tuple(stability["sampling_logprobs"][index]),
    )


def split_sequence_id(sequence_id: str) -> tuple[str, int] | None:
    """(request_id, sample index) of an id this server gave (`<request_id>:<index>`)."""
    request_id, sep, index = sequence_id.rpartition(":")
    if not sep or not request_id or not index.isdigit():
        return None
    return request_id, int(index)


def resolve(
    where: str,
    tokens_N: np.ndarray,
    inputs: Mapping[str, np.ndarray],
    provenance: Optional[Provenance],
    records: Mapping[str, StabilityRecord],
) -> dict[str, np.ndarray]:
    """The datum's `stability_logprobs` and `stability_mask`, after checking its provenance
    against `records` (every sequence id it names must be a key; the caller has refused
    unknown, foreign and expired ones)."""
    reserved = [name for name in STABILITY_INPUTS if name in inputs]
    if reserved:
        raise InvalidRequest(
            f"{where}.loss_fn_inputs holds {reserved}, which the server fills from its stability records; leave them out"
        )
    if provenance is None:
        raise InvalidRequest(
            f"{where} has no provenance spans; loss_fn 'stable_reinforce' needs them on every datum "
            "(Datum.with_provenance, naming sequences sampled with record_stability_info=true)"
        )
    n = int(tokens_N.shape[0])
    _check_tiling(f"{where}.model_input_spans", provenance.model_input, n)
    _check_tiling(f"{where}.loss_fn_input_spans", provenance.targets, n)
    position = 0
    for index, span in enumerate(provenance.model_input):
        claimed = _claimed(f"{where}.model_input_spans[{index}]", span, records[span.sequence_id])
        actual = tokens_N[position : position + span.length]
        _check_equal(f"{where}.model_input_spans[{index}]", span, claimed, actual, "model_input")
        position += span.length
    targets_S = inputs["target_tokens"]
    if targets_S.ndim != 1:
        raise InvalidRequest(f"{where}.loss_fn_inputs['target_tokens'] must be 1-D for loss_fn 'stable_reinforce'")
    logprobs_N = np.zeros(n, dtype=np.float32)
    mask_N = np.zeros(n, dtype=np.float32)
    row = 0
    for index, span in enumerate(provenance.targets):
        label = f"{where}.loss_fn_input_spans[{index}]"
        record = records[span.sequence_id]
        claimed = _claimed(label, span, record)
        if span.kind == "sampled":
            _check_equal(label, span, claimed, targets_S[row : row + span.length], "target_tokens")
            stop = span.offset + span.length
            logprobs_N[row : row + span.length] = record.sampling_logprobs[span.offset : stop]
            mask_N[row : row + span.length] = 1.0
        row += span.length
    advantages_N = inputs["advantages"]
    stray = np.flatnonzero((mask_N == 0) & (advantages_N != 0))
    if stray.size:
        raise InvalidRequest(
            f"{where}.loss_fn_inputs['advantages'] is non-zero at row {int(stray[0])}, which no sampled provenance "
            "span backs; loss_fn 'stable_reinforce' trains on sampled tokens only (give prompt rows advantage 0)"
        )
    return {STABILITY_LOGPROBS: logprobs_N, STABILITY_MASK: mask_N}


def _check_tiling(where: str, spans: tuple[Span, ...], n: int) -> None:
    total = sum(span.length for span in spans)
    if total != n:
        raise InvalidRequest(f"{where} cover {total} positions but the datum has {n}; the runs must tile it exactly")


def _claimed(where: str, span: Span, record: StabilityRecord) -> tuple[int, ...]:
    source = record.prompt_tokens if span.kind == "prompt" else record.tokens
    if span.offset < 0 or span.length < 0 or span.offset + span.length > len(source):
        raise InvalidRequest(
            f"{where} claims {span.kind} positions [{span.offset}, {span.offset + span.length}) of sequence "
            f"{span.sequence_id!r}, which has {len(source)} {span.kind} tokens"
        )
    return source[span.offset : span.offset + span.length]


def _check_equal(where: str, span: Span, claimed: tuple[int, ...], actual: np.ndarray, field: str) -> None:
    differs = np.flatnonzero(np.asarray(claimed, dtype=np.int64) != actual.astype(np.int64))
    if differs.size:
        at = int(differs[0])
        raise InvalidRequest(
            f"{where}: {field} holds token {int(actual[at])} where sequence {span.sequence_id!r} has "
            f"{claimed[at]} ({span.kind} position {span.offset + at}); the datum does not reproduce the recorded sample"
        )
