"""How forward_backward requests of several LoRA models become shared passes, bitwise as alone.

Pure planning, no tensors: a request is its datums' lengths; a plan is a list of passes.

- A datum is right-padded to its *bucket*: its length rounded up to a multiple of
  `PAD_MULTIPLE` (16). It depends on the datum alone, so a datum is computed at the same
  length whatever it shares a pass with, and every matrix product of a pass has at least 16
  rows: the CPU kernels give each row the same bits at any row count from 16 up (below that
  they switch paths), which is what makes a datum's numbers independent of its neighbours.
- A request's datums are grouped by bucket (shortest first) into *units* of at most
  `max_tokens` padded tokens (a lone datum longer than that is a unit of its own). A unit is
  what one model contributes to one pass and is never split: its adapter's gradient is one
  product over exactly its rows, packed or alone.
- A pass holds units of one bucket, at most one unit per model (two units of one model, even
  of two of its requests, in
  one pass would fuse into one product and round differently), within `max_tokens` and
  `max_rows`. Passes run in the order they are planned, in which each model's units keep
  their order, so its gradients accumulate in the same order as alone.

- Sharing is bounded by cost, not only by tokens: a pass that holds more than one unit stays
  within `max_shared_tokens`, which the engine derives from a memory budget and the bytes one
  padded token costs the pass (its logits row over the vocabulary plus the decoder's saved
  activations). Measured here: small passes gain from sharing (more rows per matrix product,
  one Python walk of the model instead of several), big ones lose (a pass's activations and
  logits outgrow the caches). A unit alone is never limited by it, so a big request runs as
  it would anyway.

Running a request alone is the same plan with one request, so "alone" and "packed" are one
code path and differ only in who shares the passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

PAD_MULTIPLE = 16


@dataclass(frozen=True)
class Limits:
    max_tokens: int  # padded tokens of one pass (and of one unit)
    max_rows: int
    max_shared_tokens: int | None = None  # padded tokens of a pass of two or more units


def bucket(length: int) -> int:
    return max(PAD_MULTIPLE, -(-length // PAD_MULTIPLE) * PAD_MULTIPLE)


@dataclass(frozen=True)
class Unit:
    request: int  # index of the request it belongs to
    bucket: int
    datums: tuple[int, ...]  # indices into the request's batch, in order

    @property
    def tokens(self) -> int:
        return self.bucket * len(self.datums)


def units(request: int, lengths: Sequence[int], max_tokens: int) -> list[Unit]:
    """One request's datums as units: by bucket (ascending), in datum order within a bucket."""
    by_bucket: dict[int, list[int]] = {}
    for index, length in enumerate(lengths):
        by_bucket.setdefault(bucket(length), []).append(index)
    out: list[Unit] = []
    for size in sorted(by_bucket):
        rows = max(1, max_tokens // size)
        members = by_bucket[size]
        for start in range(0, len(members), rows):
            out.append(Unit(request, size, tuple(members[start : start + rows])))
    return out


def plan(
    requests: Sequence[Sequence[int]],
    max_tokens: int,
    max_rows: int,
    models: Sequence[str] | None = None,
    max_shared_tokens: int | None = None,
) -> list[list[Unit]]:
    """Passes for several requests (each given by its datums' lengths; `models[i]` the model
    request i belongs to, default one model each).

    Each request's units are taken in order; a unit joins the first pass of its bucket, after
    its model's previous unit's pass, that has room and holds nothing of its model. Two
    requests of one model thus run one after the other, as they would alone. `max_shared_tokens`
    (default `max_tokens`) bounds a pass that would hold two or more units.
    """
    if max_tokens < 1 or max_rows < 1:
        raise ValueError("max_tokens and max_rows must be positive")
    models = list(models) if models is not None else [str(i) for i in range(len(requests))]
    shared = min(max_tokens, max_shared_tokens if max_shared_tokens is not None else max_tokens)
    passes: list[list[Unit]] = []
    last: dict[str, int] = {}  # model -> position of its latest unit's pass
    for index, lengths in enumerate(requests):
        model = models[index]
        for unit in units(index, lengths, max_tokens):
            for position in range(last.get(model, -1) + 1, len(passes)):
                members = passes[position]
                if (
                    members[0].bucket == unit.bucket
                    and all(models[m.request] != model for m in members)
                    and sum(m.tokens for m in members) + unit.tokens <= shared
                    and sum(len(m.datums) for m in members) + len(unit.datums) <= max_rows
                ):
                    members.append(unit)
                    last[model] = position
                    break
            else:
                passes.append([unit])
                last[model] = len(passes) - 1
    return passes
