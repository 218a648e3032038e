"""The gateway's checks of SDK 0.38's scoring fields on `asample`, before anything is stored.

`topk_sample_logprobs` (top-k at every sampled position), `target_prompt_logprobs` (chosen
ids scored at chosen prompt positions, dense or sparse CSR) and `prompt_alt_tokens_k` (k
draws from the model at every prompt position after the first) are served by both sampling
engines (`functions/sampler/prompt_scoring.py`). Their cost is bounded as the SDK documents:
`len(prompt) x distinct ids` and `len(prompt) x k` may not exceed what the widest top-k the
server serves costs at the model's full context (`max_cells`).
"""

from __future__ import annotations

from openrl_core.errors import InvalidRequest
from openrl_core.prompt_targets import TargetIds, check_prompt_cells
from openrl_core.wire.sampling import SampleRequest

MAX_TOPK_SAMPLE = 64  # as topk_prompt_logprobs


def check_prompt_scoring(body: SampleRequest, prompt_length: int, vocab_size: int, max_cells: int) -> None:
    if not 0 <= body.topk_sample_logprobs <= MAX_TOPK_SAMPLE:
        raise InvalidRequest(f"topk_sample_logprobs must be between 0 and {MAX_TOPK_SAMPLE}")
    if body.prompt_alt_tokens_k < 0:
        raise InvalidRequest(f"prompt_alt_tokens_k must be 0 or greater, got {body.prompt_alt_tokens_k}")
    wants_rows = body.prompt_alt_tokens_k > 0 or body.target_prompt_logprobs is not None
    if wants_rows and prompt_length < 2:
        raise InvalidRequest(
            "target_prompt_logprobs and prompt_alt_tokens_k score prompt positions after the first: "
            "the prompt needs at least 2 tokens"
        )
    if body.prompt_alt_tokens_k > 0:
        check_prompt_cells("prompt_alt_tokens_k", prompt_length, body.prompt_alt_tokens_k, max_cells)
    if body.target_prompt_logprobs is not None:
        targets = TargetIds.from_wire(body.target_prompt_logprobs, prompt_length, vocab_size)
        check_prompt_cells("target_prompt_logprobs", prompt_length, targets.distinct_ids, max_cells)
