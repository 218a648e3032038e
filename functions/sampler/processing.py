"""Logits processing for one decode step: per-row temperature, top-k, top-p, sampling.

Pure tensor functions over a batch of rows, each row with its own parameters; no model,
no state, no random generator. Randomness comes in as one uniform number per row
(`uniform_R`), drawn by the caller from that row's job generator, so a job's samples do
not depend on what else shares the batch and tests can pin the exact token drawn.

Conventions, shared with vLLM and HF:
- temperature 0 means greedy (argmax of the raw logits; the first index on ties);
- top_k = -1 (or >= vocab) means no limit, top_p = 1 means no nucleus cut;
- top-k is applied first, then top-p on the renormalised top-k distribution;
- top-p keeps the smallest prefix of tokens, by decreasing probability, whose mass is
  >= p: token j is kept iff the mass of the tokens ranked strictly before it is < p.
Both cuts are turned into a logit threshold, so tokens tied with the last kept token are
all kept (the kept set is then larger than k or than the minimal nucleus); the other
choice, an arbitrary subset of the tie, would depend on the sort's tie order.

`token_logprobs` is the raw log p(token) (temperature 1, unfiltered) that the result
reports, whatever the row's sampling parameters.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def token_logprobs(logits_R_V: torch.Tensor, tokens_R: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] per row, in float32, without materialising the softmax."""
    logits_R_V = logits_R_V.float()
    chosen_R = logits_R_V.gather(1, tokens_R.view(-1, 1)).squeeze(1)
    return chosen_R - torch.logsumexp(logits_R_V, dim=-1)


def effective_top_k(top_k_R: torch.Tensor, vocab: int) -> torch.Tensor:
    """top_k with "no limit" (-1, or anything >= vocab) spelled as `vocab`."""
    return torch.where((top_k_R > 0) & (top_k_R < vocab), top_k_R, torch.full_like(top_k_R, vocab))


def filter_logits(
    logits_R_V: torch.Tensor, temperature_R: torch.Tensor, top_k_R: torch.Tensor, top_p_R: torch.Tensor
) -> torch.Tensor:
    """Temperature-scaled logits with the tokens cut by top-k / top-p set to -inf.

    Rows with temperature 0 are scaled by 1 (their sample is the argmax, taken elsewhere).
    """
    vocab = logits_R_V.shape[-1]
    safe_temperature_R = torch.where(temperature_R > 0, temperature_R, torch.ones_like(temperature_R))
    scaled_R_V = logits_R_V.float() / safe_temperature_R.view(-1, 1)
    k_R = effective_top_k(top_k_R, vocab)
    has_k_R = k_R < vocab
    cuts_p_R = top_p_R < 1.0
    filtered_R = cuts_p_R | has_k_R
    if not bool(filtered_R.any()):
        return scaled_R_V
    # Every survivor of a row lies among its `candidates_R` best tokens, so one topk over
    # the largest such window serves all rows; a full-vocabulary sort (slow on CPU) is
    # needed only when some row's nucleus may really reach that far.
    candidates_R = k_R
    nucleus_only_R = cuts_p_R & ~has_k_R
    if bool(nucleus_only_R.any()):
        log_norm_R = torch.logsumexp(scaled_R_V, dim=-1)
        # A token of probability below (1 - p) / V is never in the nucleus: all such tokens
        # together weigh less than 1 - p, so the mass ranked before it exceeds p. Halving
        # the bound leaves room for rounding.
        log_bound_R = torch.log((1.0 - top_p_R).clamp(min=1e-30) / (2 * vocab))
        above_R = (scaled_R_V >= (log_norm_R + log_bound_R).view(-1, 1)).sum(dim=-1)
        candidates_R = torch.where(nucleus_only_R, above_R.clamp(min=1), k_R)
    window = int(candidates_R[filtered_R].max())
    sorted_R_K, _ = torch.topk(scaled_R_V, window, dim=-1, sorted=True)
    rank_K = torch.arange(window, device=logits_R_V.device)
    in_top_k_R_K = rank_K.view(1, -1) < k_R.view(-1, 1)
    keep_count_R = torch.minimum(k_R, torch.full_like(k_R, window))
    if bool(cuts_p_R.any()):
        masked_R_K = sorted_R_K.masked_fill(~in_top_k_R_K, NEG_INF)
        # top-p renormalises over the top-k when there is one, else over the whole vocabulary
        # (which the window may not cover, hence the full log-normaliser).
        norm_R = torch.logsumexp(masked_R_K, dim=-1)
        if bool(nucleus_only_R.any()):
            norm_R = torch.where(nucleus_only_R, log_norm_R, norm_R)
        probs_R_K = torch.exp(masked_R_K - norm_R.view(-1, 1))
        mass_before_R_K = torch.cumsum(probs_R_K, dim=-1) - probs_R_K
        in_nucleus_R_K = (mass_before_R_K < top_p_R.view(-1, 1)) & in_top_k_R_K
        # The nucleus is a prefix (mass_before only grows) and never empty (0 < p).
        nucleus_count_R = in_nucleus_R_K.sum(dim=-1)
        keep_count_R = torch.where(cuts_p_R, nucleus_count_R, keep_count_R)
    threshold_R = sorted_R_K.gather(1, (keep_count_R - 1).clamp(min=0).view(-1, 1)).squeeze(1)
    threshold_R = torch.where(filtered_R, threshold_R, torch.full_like(threshold_R, NEG_INF))
    return scaled_R_V.masked_fill(scaled_R_V < threshold_R.view(-1, 1), NEG_INF)


def sample_from_filtered(filtered_R_V: torch.Tensor, uniform_R: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the token whose CDF interval holds uniform_R (in [0, 1)).

    A sequential cumsum over a 150k vocabulary costs more than the rest of the step, so
    the CDF is walked in two levels: cumulative block masses pick the block, then a cumsum
    within that one block picks the token. Both levels accumulate in float64 so large
    vocabularies do not bias the draw. Tokens of probability 0 (cut by filtering) own an
    empty interval and are never drawn; rounding at either level is absorbed by clamping
    to the last token of non-zero mass.
    """
    rows, vocab = filtered_R_V.shape
    probs_R_V = torch.softmax(filtered_R_V, dim=-1)
    block = _block_size(vocab)
    if vocab % block:
        probs_R_V = torch.nn.functional.pad(probs_R_V, (0, block - vocab % block))
    probs_R_N_B = probs_R_V.view(rows, -1, block)
    block_cdf_R_N = torch.cumsum(probs_R_N_B.sum(dim=-1), dim=-1, dtype=torch.float64)
    total_R_1 = block_cdf_R_N[:, -1:].contiguous()
    target_R_1 = uniform_R.to(device=filtered_R_V.device, dtype=torch.float64).view(-1, 1) * total_R_1
    block_R = _clamped_search(block_cdf_R_N, target_R_1)
    mass_before_R_1 = torch.where(
        block_R.view(-1, 1) > 0, block_cdf_R_N.gather(1, (block_R - 1).clamp(min=0).view(-1, 1)), 0.0
    )
    inner_R_B = probs_R_N_B[torch.arange(rows, device=block_R.device), block_R]
    inner_cdf_R_B = torch.cumsum(inner_R_B, dim=-1, dtype=torch.float64)
    return block_R * block + _clamped_search(inner_cdf_R_B, target_R_1 - mass_before_R_1)


def _clamped_search(cdf_R_N: torch.Tensor, target_R_1: torch.Tensor) -> torch.Tensor:
    """First index whose cdf exceeds target, never past the last index of non-zero mass
    (the first index reaching the total), where rounding could otherwise land."""
    index_R = torch.searchsorted(cdf_R_N, target_R_1.contiguous(), right=True).squeeze(1)
    last_R = torch.searchsorted(cdf_R_N, cdf_R_N[:, -1:].contiguous(), right=False).squeeze(1)
    return torch.minimum(index_R, last_R)


def _block_size(vocab: int) -> int:
    """A power of two dividing the vocabulary when one is large enough (no padding copy)."""
    for block in (512, 256, 128, 64):
        if vocab % block == 0:
            return block
    return 256


def next_tokens(
    logits_R_V: torch.Tensor,
    temperature_R: torch.Tensor,
    top_k_R: torch.Tensor,
    top_p_R: torch.Tensor,
    uniform_R: torch.Tensor,
) -> torch.Tensor:
    """One token per row: argmax where temperature is 0, a filtered sample elsewhere."""
    greedy_R = temperature_R <= 0
    if bool(greedy_R.all()):
        return torch.argmax(logits_R_V, dim=-1)
    sampled_R = sample_from_filtered(filter_logits(logits_R_V, temperature_R, top_k_R, top_p_R), uniform_R)
    if not bool(greedy_R.any()):
        return sampled_R
    return torch.where(greedy_R, torch.argmax(logits_R_V, dim=-1), sampled_R)


def prompt_logprobs_and_topk(
    logits_T_V: torch.Tensor, targets_T: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """For logits at T positions and the token that followed each: its logprob, and the
    k best (token ids, logprobs) per position when k > 0. Raw distribution, float32."""
    logprobs_T_V = torch.log_softmax(logits_T_V.float(), dim=-1)
    chosen_T = logprobs_T_V.gather(1, targets_T.view(-1, 1)).squeeze(1)
    if k <= 0:
        return chosen_T, None, None
    top_values_T_k, top_ids_T_k = torch.topk(logprobs_T_V, k, dim=-1, sorted=True)
    return chosen_T, top_ids_T_k, top_values_T_k
