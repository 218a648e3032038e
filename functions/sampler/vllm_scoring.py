"""The parent's side of the scoring fields on the vLLM engine: what a request asks of the
child (`vllm_server` / `vllm_scores`) and how its answer becomes `SampleResult` fields.

- `topk_sample_logprobs = k`: vLLM's own `logprobs=k` (raw mode: the raw distribution),
  which answers the top-k plus the sampled token, with ranks; kept: ranks 1..k, best first.
- `target_prompt_logprobs`, `prompt_alt_tokens_k`: vLLM gives no per-id prompt scores on
  CPU, so the first sample row of the job asks for the whole vocabulary's prompt logprobs
  (`prompt_logprobs=-1`) and the child reduces them at once to the targets and the draws
  (and to the prompt token + top-k when prompt logprobs are asked too), so only those cross
  the pipe. Its cost is a vocabulary-wide row per prompt position inside vLLM.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from functions.sampler import prompt_scoring
from functions.sampler.engine import _first_logprob_position
from functions.sampler.types import SampleJob


def scoring_request(job: SampleJob, vocab: int, wants_prompt: bool) -> dict:
    """Fields of the job's first vLLM request (none when no scoring field is asked)."""
    if not prompt_scoring.wants_prompt_scoring(job):
        return {}
    targets = job.target_prompt_ids
    return {
        "prompt_logprobs": -1,
        "prompt_topk": job.topk_prompt_logprobs,
        "prompt_first_position": _first_logprob_position(job) if wants_prompt else None,
        "scoring": {
            "targets": None if targets is None else np.asarray(targets).tolist(),
            "first_row": prompt_scoring.first_scored_row(job),
            "alt_k": job.prompt_alt_tokens_k,
            "temperature": job.params.temperature,
            "seed": prompt_scoring.alt_seed(job.params.seed),
            "vocab": vocab,
        },
    }


def scoring_result(scores: Optional[dict]):
    """(target logprobs [R, K] float32 or None, (alt tokens, alt logprobs) or None)."""
    if scores is None:
        return None, None
    targets = None if scores["targets"] is None else np.asarray(scores["targets"], dtype=np.float32)
    alt = None
    if scores["alt_tokens"] is not None:
        alt = (np.asarray(scores["alt_tokens"], dtype=np.int64), np.asarray(scores["alt_logprobs"], dtype=np.float32))
    return targets, alt


def sampled_topk(answer: dict, k: int, length: int) -> Optional[list[list[tuple[int, float]]]]:
    """Per kept token, its k best (token, logprob) pairs by vLLM's rank; None if not asked."""
    if k <= 0:
        return None
    rows = []
    for entry in (answer.get("topk") or [])[:length]:
        best = sorted((rank, token, logprob) for token, logprob, rank in entry if rank is not None and rank <= k)
        rows.append([(int(token), float(logprob)) for _rank, token, logprob in best[:k]])
    return rows
