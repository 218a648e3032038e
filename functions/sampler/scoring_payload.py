"""The scoring fields between the sample events and the engines: into a `SampleJob`, out of a
`SampleResult` into the completion payload (what `functions/gateway/proto.py` encodes).

In the payload, beside the existing keys: each sequence gains `topk_logprobs` (per token,
[token, logprob] pairs best first) when `topk_sample_logprobs` was asked;
`target_prompt_logprobs` is a wire TensorData in the request's own layout (dense, or sparse
with its row pointers and columns: `openrl_core.prompt_targets.TargetIds.answer`);
`prompt_alt_tokens` is `{"tokens": int64 TensorData, "logprobs": float32 TensorData}`, both
dense [len(prompt) - 1, k]. Keys of fields not asked are left out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from functions.sampler.types import SampleResult
from openrl_core.prompt_targets import TargetIds, dense_tensor


def scoring_fields(data, vocab_size: int) -> dict[str, Any]:
    """`SampleJob` keyword arguments for a `SampleRequested` payload's scoring fields."""
    ids = None
    if data.target_prompt_logprobs is not None:
        ids = TargetIds.from_wire(data.target_prompt_logprobs, len(data.prompt_tokens), vocab_size).dense_ids_R_K
    return {
        "topk_sample_logprobs": data.topk_sample_logprobs,
        "target_prompt_ids": ids,
        "prompt_alt_tokens_k": data.prompt_alt_tokens_k,
    }


def add_scoring_results(payload: dict[str, Any], data, result: SampleResult) -> None:
    if data.topk_sample_logprobs > 0:
        for out, sequence in zip(payload["sequences"], result.sequences):
            out["topk_logprobs"] = [[[int(t), float(lp)] for t, lp in row] for row in (sequence.topk_logprobs or [])]
    if data.target_prompt_logprobs is not None and result.target_prompt_logprobs is not None:
        # parsed again (not kept from the job): the payload must mirror the request's layout
        targets = TargetIds.from_wire(data.target_prompt_logprobs, len(data.prompt_tokens), 2**62)
        payload["target_prompt_logprobs"] = targets.answer(np.asarray(result.target_prompt_logprobs))
    if data.prompt_alt_tokens_k > 0 and result.prompt_alt_tokens is not None:
        tokens_R_k, logprobs_R_k = result.prompt_alt_tokens
        payload["prompt_alt_tokens"] = {
            "tokens": dense_tensor(np.asarray(tokens_R_k, dtype=np.int64)),
            "logprobs": dense_tensor(np.asarray(logprobs_R_k, dtype=np.float32)),
        }
