"""What the sampler worker hands the engine and what it gets back.

A `SampleJob` is one Tinker `asample` request reduced to token ids; a `SampleResult` holds
exactly what `SampleResponse` needs (protocol §9.4). Logprobs are always under the
model's raw distribution (temperature 1, no top-k/top-p), because RL importance ratios
compare them with the trainer's logprobs of the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal, Optional, Protocol

from openrl_core.params import SamplingParams

StopReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SampleJob:
    prompt_tokens: list[int]
    num_samples: int
    params: SamplingParams
    prompt_logprobs: bool = False
    # k > 0 asks for the k most likely tokens at every prompt position, best first.
    topk_prompt_logprobs: int = 0
    # Only the last n prompt positions get (top-k) prompt logprobs; the others are None,
    # which the SDK checks (it raises if a position before the suffix has a value).
    prompt_logprobs_last_n: Optional[int] = None
    # Key given to `SamplerEngine.load_adapter`; None samples the base model.
    adapter: Optional[str] = None
    # Also report each token's logprob under the distribution it was drawn from
    # (`SampledSequence.sampling_logprobs`), StableReinforce's record (openrl_core.stability).
    record_stability_info: bool = False
    # SDK 0.38's scoring fields (`prompt_scoring` computes them): k best at each sampled
    # position; ids to score, [len(prompt) - 1, K] int64 with -1 for none; k draws per
    # prompt position after the first.
    topk_sample_logprobs: int = 0
    target_prompt_ids: Optional[Any] = None  # numpy int64 [len(prompt) - 1, K]
    prompt_alt_tokens_k: int = 0


@dataclass(frozen=True)
class SampledSequence:
    # Generated ids only; they include the stop token or the tokens that completed a
    # stop string, as the cookbook's renderers expect.
    tokens: list[int]
    # One per token: log p(token | prompt + earlier tokens) under the raw distribution.
    logprobs: list[float]
    stop_reason: StopReason
    # With `record_stability_info`: one per token, log p(token) under the distribution the
    # engine actually drew it from (temperature, top-k, top-p applied); 0.0 for a greedy
    # pick, which is certain. None when not asked.
    sampling_logprobs: Optional[list[float]] = None
    # Per generated token, k (token, logprob) pairs best first; None when not asked.
    topk_logprobs: Optional[list[list[tuple[int, float]]]] = None


@dataclass(frozen=True)
class SampleResult:
    sequences: list[SampledSequence]  # exactly num_samples, in sample order
    # len(prompt); None at position 0, before the last n positions, or when not asked.
    prompt_logprobs: Optional[list[Optional[float]]]
    # Per prompt position, k (token, logprob) pairs best first; None where not computed.
    topk_prompt_logprobs: Optional[list[Optional[list[tuple[int, float]]]]]
    # Logprobs of the job's target ids, [len(prompt) - 1, K] float32 (any value where -1).
    target_prompt_logprobs: Optional[Any] = None
    # (tokens, logprobs), each [len(prompt) - 1, k]: draws at each prompt position after the first.
    prompt_alt_tokens: Optional[tuple[Any, Any]] = None


class Engine(Protocol):
    """What the sampler worker needs of an engine; `SamplerEngine` (torch) and `VllmEngine`
    implement it, and tests/functions/sampler/test_vllm_engine.py runs both on the same jobs."""

    eos_token_ids: frozenset[int]

    def validate(self, job: SampleJob) -> None: ...
    def sample(self, jobs: list[SampleJob]) -> list[SampleResult]: ...
    def has_adapter(self, key: str) -> bool: ...
    def load_adapter(self, key: str, files: dict[str, bytes]) -> None: ...
    def drop_adapter(self, key: str) -> None: ...
    @property
    def weight_bytes(self) -> int: ...
    @property
    def model(self): ...  # torch weights that weight sync patches in place (full runs)
    def weights_changed(self, names: Optional[Iterable[str]] = None) -> None: ...  # None: all of them
