"""SDK 0.38's scoring fields, from logits: target prompt logprobs, prompt alt tokens, top-k
at sampled positions. Pure tensor functions; the torch engine calls them on its prefill and
decode logits, and the vLLM engine's child (`vllm_server`) does the same sums in numpy.

Semantics (tinker `SampleRequest` / `SampleResponse` / `PromptAltTokens` docstrings):
- every logprob is under the raw distribution (temperature 1, no top-k/top-p), as every
  other logprob the sampler reports;
- row i of `target_prompt_logprobs` and of `prompt_alt_tokens` is about prompt position
  i + 1, predicted by the logits after prompt tokens [0, i];
- `prompt_alt_tokens_k = k` draws k tokens per row, independently, with replacement, from
  softmax(logits / temperature) (the request's temperature only; top-k/top-p cut sampled
  tokens, not these draws); temperature 0 gives the argmax k times;
- the draws use a generator of their own, seeded from the request's seed, so asking for
  them never changes which tokens a seeded request samples;
- `topk_sample_logprobs = k`: at each generated token, the k most likely tokens of the
  distribution it was drawn from (raw), best first.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from functions.sampler.types import SampleJob
from openrl_core.errors import InvalidRequest

CHUNK = 512  # prompt rows turned into log-softmax at once; bounds memory on long prompts
ALT_SEED_MIX = 0x5851F42D4C957F2D  # the draws' seed: far from the sampled rows' seeds
SEED_MASK = 2**63 - 1


MAX_TOPK_SAMPLE_LOGPROBS = 256


def validate(job: SampleJob, vocab: int) -> None:
    """The engines' own checks of the fields (the gateway's, in `sampling_fields`, come first)."""
    n = len(job.prompt_tokens)
    if not 0 <= job.topk_sample_logprobs <= min(MAX_TOPK_SAMPLE_LOGPROBS, vocab):
        raise InvalidRequest(f"topk_sample_logprobs must be between 0 and {MAX_TOPK_SAMPLE_LOGPROBS}")
    if job.prompt_alt_tokens_k < 0:
        raise InvalidRequest("prompt_alt_tokens_k must be 0 or greater")
    if wants_prompt_scoring(job) and n < 2:
        raise InvalidRequest("target_prompt_logprobs and prompt_alt_tokens_k need a prompt of at least 2 tokens")
    if job.target_prompt_ids is not None:
        ids_R_K = np.asarray(job.target_prompt_ids)
        if ids_R_K.ndim != 2 or ids_R_K.shape[0] != n - 1 or ids_R_K.shape[1] < 1:
            raise InvalidRequest(f"target_prompt_logprobs must have shape [{n - 1}, K]; got {list(ids_R_K.shape)}")
        if ids_R_K.min() < -1 or ids_R_K.max() >= vocab or not (ids_R_K != -1).any():
            raise InvalidRequest(f"target_prompt_logprobs ids must lie in [0, {vocab}) or be -1, and name one id")


def wants_prompt_scoring(job: SampleJob) -> bool:
    return job.target_prompt_ids is not None or job.prompt_alt_tokens_k > 0


def first_scored_row(job: SampleJob) -> Optional[int]:
    """The first prompt row (position - 1) the scoring fields need logits for, or None."""
    if job.prompt_alt_tokens_k > 0:
        return 0
    if job.target_prompt_ids is not None:
        rows_R = np.flatnonzero((np.asarray(job.target_prompt_ids) != -1).any(axis=1))
        return int(rows_R[0])
    return None


def alt_seed(seed: Optional[int]) -> Optional[int]:
    """The seed of a job's alt-token draws; None (an unseeded job) draws fresh ones."""
    return None if seed is None else (seed * ALT_SEED_MIX + 1) & SEED_MASK


def score_prompt(job: SampleJob, logits_C_V: torch.Tensor):
    """(target logprobs [R, K] float32 or None, (alt tokens [R, k], alt logprobs [R, k]) or
    None) of one job, from its prefill logits: the last C columns of the prompt, C >= R -
    first_scored_row + 1 where R = len(prompt) - 1 (column c - C + len(prompt) predicts
    position c + 1 in prompt terms)."""
    n = len(job.prompt_tokens)
    rows = n - 1
    start = first_scored_row(job)
    if start is None:
        return None, None
    offset = logits_C_V.shape[0] - n  # prompt row r (position r + 1) is column offset + r
    targets_R_K = None
    if job.target_prompt_ids is not None:
        ids_R_K = torch.as_tensor(np.asarray(job.target_prompt_ids), dtype=torch.long)
        targets_R_K = torch.zeros(ids_R_K.shape, dtype=torch.float32)
    k = job.prompt_alt_tokens_k
    alt_tokens_R_k = torch.zeros(rows, k, dtype=torch.long) if k > 0 else None
    alt_lps_R_k = torch.zeros(rows, k, dtype=torch.float32) if k > 0 else None
    generator = torch.Generator(device="cpu")
    seed = alt_seed(job.params.seed)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    temperature = job.params.temperature
    for chunk in range(start, rows, CHUNK):
        stop = min(chunk + CHUNK, rows)
        logits_T_V = logits_C_V[offset + chunk : offset + stop].float()
        logprobs_T_V = torch.log_softmax(logits_T_V, dim=-1).cpu()
        if targets_R_K is not None:
            ids_T_K = ids_R_K[chunk:stop]
            gathered_T_K = logprobs_T_V.gather(1, ids_T_K.clamp(min=0))
            targets_R_K[chunk:stop] = torch.where(ids_T_K >= 0, gathered_T_K, torch.zeros_like(gathered_T_K))
        if k > 0:
            drawn_T_k = draw(logits_T_V.cpu(), temperature, k, generator)
            alt_tokens_R_k[chunk:stop] = drawn_T_k
            alt_lps_R_k[chunk:stop] = logprobs_T_V.gather(1, drawn_T_k)
    targets = None if targets_R_K is None else targets_R_K.numpy()
    alt = None if k == 0 else (alt_tokens_R_k.numpy(), alt_lps_R_k.numpy())
    return targets, alt


def draw(logits_T_V: torch.Tensor, temperature: float, k: int, generator: torch.Generator) -> torch.Tensor:
    """k independent draws per row from softmax(logits / temperature), with replacement."""
    if temperature <= 0:
        return logits_T_V.argmax(dim=-1, keepdim=True).expand(-1, k).clone()
    probs_T_V = torch.softmax(logits_T_V.double() / temperature, dim=-1)
    return torch.multinomial(probs_T_V, k, replacement=True, generator=generator)


def sampled_topk(logits_R_V: torch.Tensor, k_R: list[int]) -> list[Optional[list[tuple[int, float]]]]:
    """Per row, its k_R[i] best (token, raw logprob) pairs, best first; None where k is 0."""
    widest = max(k_R, default=0)
    if widest <= 0:
        return [None] * len(k_R)
    logprobs_R_V = torch.log_softmax(logits_R_V.float(), dim=-1)
    values_R_k, ids_R_k = torch.topk(logprobs_R_V, widest, dim=-1, sorted=True)
    out: list[Optional[list[tuple[int, float]]]] = []
    for k, ids, values in zip(k_R, ids_R_k.tolist(), values_R_k.tolist()):
        out.append(list(zip(ids[:k], values[:k])) if k > 0 else None)
    return out
