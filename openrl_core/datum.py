"""One training example as the trainer sees it: input token ids plus named loss inputs.

The gateway has already concatenated the datum's text chunks and expanded sparse tensors,
so a `Datum` is dense and self-contained. `validate_batch` is the single place where the
shapes and token ranges a loss needs are checked, so that a malformed request is refused
with a message before anything is queued.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from pydantic import BaseModel, ConfigDict

from openrl_core.errors import InvalidRequest
from openrl_core.losses import LossSpec, loss_spec
from openrl_core.stability import Provenance
from openrl_core.tensors import Array


@dataclass(frozen=True)
class Datum:
    tokens_N: np.ndarray  # int64 [N]: the model input
    loss_fn_inputs: dict[str, np.ndarray] = field(default_factory=dict)
    # The request's provenance spans, as decoded; only the gateway reads them (to resolve
    # stable_reinforce's records, `openrl_core.stability`): an event does not carry them.
    provenance: Optional[Provenance] = None


class DatumRecord(BaseModel):
    """A `Datum` as it travels inside an event."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens: Array
    loss_fn_inputs: dict[str, Array]

    @classmethod
    def from_datum(cls, datum: Datum) -> "DatumRecord":
        return cls(
            tokens=Array.from_numpy(datum.tokens_N),
            loss_fn_inputs={name: Array.from_numpy(value) for name, value in datum.loss_fn_inputs.items()},
        )

    def to_datum(self) -> Datum:
        return Datum(
            tokens_N=self.tokens.to_numpy().astype(np.int64, copy=False),
            loss_fn_inputs={name: value.to_numpy() for name, value in self.loss_fn_inputs.items()},
        )


def validate_batch(batch: list[Datum], loss_fn: str, vocab_size: int, max_length: int | None = None) -> LossSpec:
    """Check every datum against the loss's input spec; raise InvalidRequest naming the datum."""
    spec = loss_spec(loss_fn)
    if not batch:
        raise InvalidRequest("forward_backward needs at least one datum")
    for index, datum in enumerate(batch):
        where = f"data[{index}]"
        tokens = datum.tokens_N
        if tokens.ndim != 1 or tokens.size == 0:
            raise InvalidRequest(f"{where}.model_input must hold at least one token")
        if max_length is not None and tokens.size > max_length:
            raise InvalidRequest(f"{where}.model_input has {tokens.size} tokens; the model's context is {max_length}")
        _check_token_range(tokens, vocab_size, f"{where}.model_input")
        _check_inputs(datum, spec, where, vocab_size)
    return spec


def _check_token_range(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        bad = int(tokens.max()) if int(tokens.max()) >= vocab_size else int(tokens.min())
        raise InvalidRequest(f"{where} holds token id {bad}, outside the vocabulary [0, {vocab_size})")


def _check_inputs(datum: Datum, spec: LossSpec, where: str, vocab_size: int) -> None:
    inputs = datum.loss_fn_inputs
    missing = [name for name in spec.required if name not in inputs]
    if missing:
        raise InvalidRequest(f"{where}.loss_fn_inputs lacks {missing} required by loss_fn {spec.name!r}")
    unknown = sorted(set(inputs) - set(spec.required) - set(spec.optional))
    if unknown:
        allowed = sorted(set(spec.required) | set(spec.optional))
        raise InvalidRequest(
            f"{where}.loss_fn_inputs has unknown keys {unknown} for loss_fn {spec.name!r}; allowed: {allowed}"
        )
    n = datum.tokens_N.size
    targets = inputs["target_tokens"]
    if targets.ndim not in (1, 2) or targets.shape[0] != n:
        raise InvalidRequest(
            f"{where}.loss_fn_inputs['target_tokens'] has shape {list(targets.shape)}; "
            f"its first dimension must equal the model_input length {n}"
        )
    if not np.issubdtype(targets.dtype, np.integer):
        raise InvalidRequest(f"{where}.loss_fn_inputs['target_tokens'] must be int64, got {targets.dtype}")
    _check_token_range(targets, vocab_size, f"{where}.loss_fn_inputs['target_tokens']")
    for name, value in inputs.items():
        if name == "target_tokens":
            continue
        if not np.issubdtype(value.dtype, np.floating):
            raise InvalidRequest(f"{where}.loss_fn_inputs[{name!r}] must be float32, got {value.dtype}")
        if value.shape != targets.shape:
            raise InvalidRequest(
                f"{where}.loss_fn_inputs[{name!r}] has shape {list(value.shape)}; it must match target_tokens {list(targets.shape)}"
            )
        if not np.all(np.isfinite(value)):
            raise InvalidRequest(f"{where}.loss_fn_inputs[{name!r}] holds NaN or infinite values")
