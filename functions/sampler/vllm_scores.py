"""The vLLM child's side of SDK 0.38's prompt scoring fields: from vLLM's full-vocabulary
prompt logprobs (`prompt_logprobs=-1`, flat lists, raw logprobs) to what the parent needs.

Runs inside the vLLM virtualenv (loaded by `vllm_server`): standard library and numpy only.
The sums are those of `prompt_scoring` (the torch engine), on the same raw distribution:
row i of the targets and draws is prompt position i + 1; draws are k independent samples,
with replacement, from softmax(logprobs / temperature), the argmax k times at temperature
0, from a numpy generator of their own seeded by the parent (so they never touch the
sampled rows' seeds). The draws are therefore the same distribution as the torch
engine's, not the same tokens. For prompt logprobs asked beside them, the answer is cut
down to what the parent reads (the prompt token and the top-k, with ranks), as vLLM would
have answered `prompt_logprobs=k`.
"""

from __future__ import annotations

import numpy as np


def score(flat, request: dict):
    """(prompt entries or None, {"targets": [[...]] or None, "alt_tokens", "alt_logprobs"})."""
    scoring = request["scoring"]
    prompt = request["prompt"]
    n = len(prompt)
    ids_all = np.asarray(flat.token_ids, dtype=np.int64)
    lps_all = np.asarray(flat.logprobs, dtype=np.float64)
    vocab = max(int(scoring["vocab"]), int(ids_all.max()) + 1 if ids_all.size else 0)

    def row_logprobs(position: int) -> np.ndarray:
        start, end = flat.start_indices[position], flat.end_indices[position]
        logprobs_V = np.full(vocab, -np.inf)
        logprobs_V[ids_all[start:end]] = lps_all[start:end]
        return logprobs_V

    targets = np.asarray(scoring["targets"], dtype=np.int64) if scoring.get("targets") is not None else None
    k = int(scoring.get("alt_k") or 0)
    temperature = float(scoring["temperature"])
    rng = np.random.default_rng(scoring.get("seed"))
    first = int(scoring["first_row"])
    topk = int(request.get("prompt_topk") or 0)
    first_prompt = request.get("prompt_first_position")
    target_values = np.zeros(targets.shape, dtype=np.float64) if targets is not None else None
    alt_tokens = np.zeros((n - 1, k), dtype=np.int64)
    alt_logprobs = np.zeros((n - 1, k), dtype=np.float64)
    entries: list = [None] * n
    for position in range(1, n):
        row = position - 1
        wants_prompt = first_prompt is not None and position >= first_prompt
        if row < first and not wants_prompt:
            continue
        logprobs_V = row_logprobs(position)
        if wants_prompt:
            token = prompt[position]
            best = np.argsort(-logprobs_V, kind="stable")[:topk] if topk > 0 else []
            chosen = {int(t): (float(logprobs_V[t]), rank + 1) for rank, t in enumerate(best)}
            chosen.setdefault(token, (float(logprobs_V[token]), int((logprobs_V > logprobs_V[token]).sum()) + 1))
            entries[position] = [[t, lp, rank] for t, (lp, rank) in chosen.items()]
        if row < first:
            continue
        if target_values is not None:
            ids_K = targets[row]
            target_values[row] = np.where(ids_K >= 0, logprobs_V[np.clip(ids_K, 0, None)], 0.0)
        if k > 0:
            if temperature <= 0:
                drawn_k = np.full(k, int(np.argmax(logprobs_V)))
            else:
                scaled_V = logprobs_V / temperature
                probs_V = np.exp(scaled_V - scaled_V.max())
                drawn_k = rng.choice(vocab, size=k, replace=True, p=probs_V / probs_V.sum())
            alt_tokens[row] = drawn_k
            alt_logprobs[row] = logprobs_V[drawn_k]
    scores = {
        "targets": None if target_values is None else target_values.tolist(),
        "alt_tokens": alt_tokens.tolist() if k > 0 else None,
        "alt_logprobs": alt_logprobs.tolist() if k > 0 else None,
    }
    return (entries if first_prompt is not None else None), scores
