"""What a sampler adds to a sample's result when asked to `record_stability_info`.

Both engines report, per sampled token, its logprob under the distribution it was actually
drawn from (`SampledSequence.sampling_logprobs`); this module puts those, with the prompt,
into the completion's `stability` entry (`openrl_core.stability.record_payload`), which the
event store keeps and the gateway reads back when a stable_reinforce datum names the
sequence. The entry is beside the wire fields, so no SDK ever sees it.

`sampling_logprobs_of` is the torch engine's rule, shared with the tests: the raw logits
scaled and cut exactly as `processing.filter_logits` does before drawing, then
log-softmaxed; a greedy row's pick is certain (0.0).
"""

from __future__ import annotations

import torch

from functions.sampler import processing
from functions.sampler.types import SampleResult
from openrl_core.errors import ServerError
from openrl_core.stability import record_payload


def sampling_logprobs_of(
    logits_R_V: torch.Tensor,
    temperature_R: torch.Tensor,
    top_k_R: torch.Tensor,
    top_p_R: torch.Tensor,
    tokens_R: torch.Tensor,
) -> torch.Tensor:
    """log q(token) per row, q the filtered distribution the row drew from; float32."""
    filtered_R_V = processing.filter_logits(logits_R_V, temperature_R, top_k_R, top_p_R)
    chosen_R = filtered_R_V.gather(1, tokens_R.view(-1, 1)).squeeze(1) - torch.logsumexp(filtered_R_V, dim=-1)
    return torch.where(temperature_R > 0, chosen_R, torch.zeros_like(chosen_R)).float()


def stability_entry(prompt_tokens: list[int], result: SampleResult) -> dict:
    """The completion's `stability` entry; every sequence must carry its sampling logprobs."""
    pairs = []
    for index, sequence in enumerate(result.sequences):
        if sequence.sampling_logprobs is None or len(sequence.sampling_logprobs) != len(sequence.tokens):
            raise ServerError(f"the sampling engine kept no stability record for sequence {index}")
        pairs.append((sequence.tokens, sequence.sampling_logprobs))
    return record_payload(prompt_tokens, pairs)
