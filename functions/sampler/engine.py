"""`SamplerEngine`: one causal LM, its LoRA adapters, and batched generation with a KV cache.

`sample(jobs)` runs every row of every job (a job contributes `num_samples` rows) through
one generation loop, in waves of at most `max_batch_rows` rows:

- schedule: `plan_waves` packs jobs into waves; a job too big for one wave is split and
  its pieces run in order on the job's generator, so a seeded job stays reproducible
  (for a given `max_batch_rows`: the split decides which row gets which draw);
- prefill: each piece's prompt runs once, left-padded, with explicit per-row positions;
  its KV cache rows are then replicated for the piece's samples (HF generate prefills
  every copy), and prompt logprobs come from this same forward pass;
- decode: one forward per step over the live rows only; a row that stops is removed from
  the cache at once, so long tails do not pay for finished rows.

Invariants: rows of one job draw uniforms only from that job's `torch.Generator`, in row
order, one per live row per step, so another job in the batch never changes them;
reported logprobs are always under the raw distribution (see `processing`); each row
gets its own adapter's LoRA (`lora`: tensors beside the unmodified base), and a wave's pieces
are ordered so that rows sharing an adapter are contiguous, one slice per adapter per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from functions.compute.models import ModelFiles, load_causal_lm, load_tokenizer
from functions.compute.shared_weights import load_frozen
from functions.sampler import processing, prompt_scoring
from functions.sampler.lora import LoraAdapters
from functions.sampler.stability import sampling_logprobs_of
from functions.sampler.stops import StopRule, make_decoder
from functions.sampler.types import SampledSequence, SampleJob, SampleResult, StopReason
from openrl_core.errors import InvalidRequest

MAX_NUM_SAMPLES = 1024
MAX_TOPK_PROMPT_LOGPROBS = 256
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
# Prompt positions turned into log-softmax at once; bounds memory on long prompts.
PROMPT_LOGPROB_CHUNK = 512
# Most prefill logits (prompt positions x vocabulary, float32) one wave may hold: 1 GiB.
PREFILL_LOGITS_BUDGET = 2**28


def require_adapter_files(key: str, files: dict[str, bytes]) -> None:
    """An adapter's saved files must hold both PEFT files (either engine loads from them)."""
    missing = [name for name in ADAPTER_FILES if name not in files]
    if missing:
        raise InvalidRequest(f"adapter {key!r} lacks {', '.join(missing)}")


@dataclass(frozen=True)
class Piece:
    """Samples [first, first + count) of job `job`, run within one wave."""

    job: int
    first: int
    count: int


def plan_waves(
    samples_per_job: list[int],
    max_rows: int,
    logit_columns: list[int] | None = None,
    max_logit_rows: int | None = None,
) -> list[list[Piece]]:
    """Pack jobs in order into waves of at most `max_rows` rows, splitting big jobs.

    The prefill keeps, for every piece of a wave, as many logit columns as the wave's
    widest prompt-logprob request (`logit_columns[job]`, 1 without one), so a wave is also
    closed once pieces x widest would pass `max_logit_rows`: one long prompt-logprobs job
    must not make every neighbour materialise a full-vocabulary row per prompt token. A
    job that alone exceeds the budget still runs, in a wave of its own.
    """
    columns = logit_columns or [1] * len(samples_per_job)
    waves: list[list[Piece]] = [[]]
    space, widest = max_rows, 1
    for job, total in enumerate(samples_per_job):
        first = 0
        while first < total:
            width = columns[job] if first == 0 else 1  # later pieces compute no prompt logprobs
            pieces = len(waves[-1])
            too_wide = max_logit_rows is not None and (pieces + 1) * max(widest, width) > max_logit_rows
            if space == 0 or (pieces and too_wide):
                waves.append([])
                space, widest = max_rows, 1
            count = min(total - first, space)
            waves[-1].append(Piece(job, first, count))
            widest = max(widest, width)
            first += count
            space -= count
    return [wave for wave in waves if wave]


@dataclass
class _Row:
    piece: int  # index into the wave's pieces
    budget: int  # tokens this row may still generate
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: StopReason = "length"
    sampling_logprobs: Optional[list[float]] = None  # kept when the job records stability info
    topk: Optional[list] = None  # per token, its top-k pairs (topk_sample_logprobs)


class SamplerEngine:
    def __init__(
        self, files: ModelFiles, device: str = "cpu", max_batch_rows: int = 64, dtype=None, share_base: bool = False
    ) -> None:
        """`share_base`: serve this process's one frozen copy of the base (`shared_weights`),
        for an engine whose base weights are never written; a full run's copy, which weight
        sync patches in place, must load its own (the default)."""
        if max_batch_rows < 1:
            raise ValueError("max_batch_rows must be >= 1")
        self.files = files
        self.device = torch.device(device)
        self.max_batch_rows = max_batch_rows
        load = load_frozen if share_base else load_causal_lm
        self._model = load(files, dtype=dtype, device=device).eval()
        self._lora = LoraAdapters(self._model, files.name)
        tokenizer = load_tokenizer(files)
        self._decode = make_decoder(tokenizer)
        eos = set(files.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)

    @property
    def model(self) -> torch.nn.Module:
        """The base model: a plain Hugging Face model (adapters live beside it, in `_lora`)."""
        return self._model

    @property
    def weight_bytes(self) -> int:
        """Bytes of the base weights, which the worker registers with the timeslicer."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def weights_changed(self, names=None) -> None:
        """Weight sync patched `.model` in place; nothing to do here (the vLLM engine copies them)."""

    # ------------------------------------------------------------------ validation

    def validate(self, job: SampleJob) -> None:
        validate_job(job, self.files, self.eos_token_ids, self._lora)

    # ------------------------------------------------------------------ adapters

    def has_adapter(self, key: str) -> bool:
        return key in self._lora

    def load_adapter(self, key: str, files: dict[str, bytes]) -> None:
        """Load a PEFT LoRA adapter from its saved files; loading a key again replaces it."""
        require_adapter_files(key, files)
        self._lora.load(key, files)

    def drop_adapter(self, key: str) -> None:
        """Unload an adapter; unknown keys are ignored so eviction can be retried."""
        self._lora.drop(key)

    # ------------------------------------------------------------------ sampling

    def sample(self, jobs: list[SampleJob]) -> list[SampleResult]:
        """Sample every job; raises InvalidRequest if any job is invalid (validate first)."""
        for job in jobs:
            self.validate(job)
        generators = []
        for job in jobs:
            generator = torch.Generator()
            if job.params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(job.params.seed)
            generators.append(generator)
        rules = [StopRule.from_params(job.params, self.eos_token_ids) for job in jobs]
        sequences: list[list[Optional[SampledSequence]]] = [[None] * job.num_samples for job in jobs]
        prompt_lps: list[Optional[list]] = [None] * len(jobs)
        topk_lps: list[Optional[list]] = [None] * len(jobs)
        scores: list[tuple] = [(None, None)] * len(jobs)  # prompt_scoring.score_prompt per job
        with torch.inference_mode():
            columns = [_logit_columns(job) for job in jobs]
            max_logit_rows = max(1, PREFILL_LOGITS_BUDGET // self.files.vocab_size)
            for wave in plan_waves([job.num_samples for job in jobs], self.max_batch_rows, columns, max_logit_rows):
                pieces = by_adapter(wave, jobs)
                self._run_wave(pieces, jobs, generators, rules, sequences, prompt_lps, topk_lps, scores)
        return [
            SampleResult(
                sequences=list(seqs),  # type: ignore[arg-type]
                prompt_logprobs=plp,
                topk_prompt_logprobs=tlp,
                target_prompt_logprobs=score[0],
                prompt_alt_tokens=score[1],
            )
            for seqs, plp, tlp, score in zip(sequences, prompt_lps, topk_lps, scores)
        ]

    def _forward(
        self, input_ids, attention_mask, position_ids, cache, adapters: list[Optional[str]], logits_to_keep: int
    ):
        """Logits of one pass; row i with the adapter `adapters[i]` (None: the base model)."""
        kwargs = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        with self._lora.applied(adapters):
            return self._model(**kwargs).logits

    def _run_wave(self, pieces, jobs, generators, rules, sequences, prompt_lps, topk_lps, scores) -> None:
        cache, mask_P_L, logits_P_V = self._prefill(pieces, jobs, prompt_lps, topk_lps, scores)
        rows = [
            _Row(piece=i, budget=_budget(jobs[p.job], self.files.max_context))
            for i, p in enumerate(pieces)
            for _ in range(p.count)
        ]
        for row in rows:
            if jobs[pieces[row.piece].job].record_stability_info:
                row.sampling_logprobs = []
        live = [r for r in rows if r.budget > 0]
        if live:
            device = self.device
            row_piece_R = torch.tensor([r.piece for r in live], device=device)
            cache.reorder_cache(row_piece_R)  # replicate each prompt's cache for its samples
            logits_R_V = logits_P_V[row_piece_R]
            mask_R_T = mask_P_L[row_piece_R]
            position_R = mask_R_T.sum(dim=1)  # the next token's position: the prompt length
            params = [jobs[pieces[r.piece].job].params for r in live]
            temperature_R = torch.tensor([p.temperature for p in params], device=device)
            top_k_R = torch.tensor([p.top_k for p in params], device=device)
            top_p_R = torch.tensor([p.top_p for p in params], device=device)
            adapters = [jobs[pieces[r.piece].job].adapter for r in live]
            topk_k_R = [jobs[pieces[r.piece].job].topk_sample_logprobs for r in live]
        del logits_P_V  # prompt-logprob columns can be large; the decode loop needs none
        while live:
            uniform_R = self._draw_uniforms(live, pieces, jobs, generators)
            tokens_R = processing.next_tokens(logits_R_V, temperature_R, top_k_R, top_p_R, uniform_R)
            logprobs_R = processing.token_logprobs(logits_R_V, tokens_R)
            behaviour = [None] * len(live)
            if any(row.sampling_logprobs is not None for row in live):
                behaviour = sampling_logprobs_of(logits_R_V, temperature_R, top_k_R, top_p_R, tokens_R).tolist()
            topk_R = prompt_scoring.sampled_topk(logits_R_V, topk_k_R)
            kept: list[int] = []
            for i, (row, token, logprob) in enumerate(zip(live, tokens_R.tolist(), logprobs_R.tolist())):
                row.tokens.append(token)
                row.logprobs.append(logprob)
                if row.sampling_logprobs is not None:
                    row.sampling_logprobs.append(behaviour[i])
                if topk_R[i] is not None:
                    row.topk = (row.topk or []) + [topk_R[i]]
                row.budget -= 1
                if rules[pieces[row.piece].job].is_stop(row.tokens, self._decode):
                    row.stop_reason = "stop"
                elif row.budget > 0:
                    kept.append(i)
            if not kept:
                break
            if len(kept) < len(live):  # finished rows leave the batch and the cache now
                index_R = torch.tensor(kept, device=self.device)
                cache.reorder_cache(index_R)
                live, adapters = [live[i] for i in kept], [adapters[i] for i in kept]
                topk_k_R = [topk_k_R[i] for i in kept]
                tokens_R, mask_R_T, position_R = tokens_R[index_R], mask_R_T[index_R], position_R[index_R]
                temperature_R, top_k_R, top_p_R = temperature_R[index_R], top_k_R[index_R], top_p_R[index_R]
            mask_R_T = torch.cat([mask_R_T, mask_R_T.new_ones(len(live), 1)], dim=1)
            logits_R_1_V = self._forward(tokens_R.view(-1, 1), mask_R_T, position_R.view(-1, 1), cache, adapters, 1)
            logits_R_V = logits_R_1_V[:, -1]
            position_R = position_R + 1

        next_sample = [p.first for p in pieces]
        for row in rows:  # rows are in piece order, samples in order within a piece
            asked = jobs[pieces[row.piece].job].topk_sample_logprobs > 0
            sequence = SampledSequence(
                row.tokens, row.logprobs, row.stop_reason, row.sampling_logprobs, (row.topk or []) if asked else None
            )
            sequences[pieces[row.piece].job][next_sample[row.piece]] = sequence
            next_sample[row.piece] += 1

    def _prefill(self, pieces, jobs, prompt_lps, topk_lps, scores):
        """One forward over the wave's left-padded prompts. Fills prompt logprobs; returns
        the cache, the attention mask and each prompt's next-token logits."""
        from transformers import DynamicCache

        prompts = [jobs[p.job].prompt_tokens for p in pieces]
        width = max(len(prompt) for prompt in prompts)
        input_ids_P_L = torch.zeros(len(pieces), width, dtype=torch.long)
        mask_P_L = torch.zeros(len(pieces), width, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids_P_L[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask_P_L[i, width - len(prompt) :] = 1
        # Padding takes no position: each prompt's first real token is at position 0.
        positions_P_L = (mask_P_L.cumsum(-1) - 1).clamp(min=0)
        adapters = [jobs[p.job].adapter for p in pieces]
        # Logits at column c predict column c + 1. Every piece's wanted columns end at the
        # last one, so keeping the last `keep` columns covers them all.
        wants = [i for i, p in enumerate(pieces) if p.first == 0 and _wants_prompt_logprobs(jobs[p.job])]
        keep = max([1] + [_logit_columns(jobs[pieces[i].job]) for i in wants])
        cache = DynamicCache(config=self._model.config)  # the config gives sliding-window layers their kind
        device = self.device
        mask_P_L = mask_P_L.to(device)
        logits_P_C_V = self._forward(
            input_ids_P_L.to(device), mask_P_L, positions_P_L.to(device), cache, adapters, keep
        )
        for i in wants:
            job_index = pieces[i].job
            job = jobs[job_index]
            if job.prompt_logprobs or job.topk_prompt_logprobs > 0:
                prompt_lps[job_index], topk_lps[job_index] = self._prompt_logprobs(job, logits_P_C_V[i])
            if prompt_scoring.wants_prompt_scoring(job):
                scores[job_index] = prompt_scoring.score_prompt(job, logits_P_C_V[i])
        return cache, mask_P_L, logits_P_C_V[:, -1]

    def _draw_uniforms(self, live: list[_Row], pieces, jobs, generators) -> torch.Tensor:
        """One uniform per live row from its job's generator; rows of a piece are contiguous."""
        counts: dict[int, int] = {}
        for row in live:
            counts[row.piece] = counts.get(row.piece, 0) + 1
        parts = []
        for piece_index, count in counts.items():
            job = pieces[piece_index].job
            if jobs[job].params.temperature > 0:
                parts.append(torch.rand(count, generator=generators[job], dtype=torch.float64))
            else:
                parts.append(torch.zeros(count, dtype=torch.float64))
        return torch.cat(parts)

    def _prompt_logprobs(self, job: SampleJob, logits_C_V: torch.Tensor):
        """Prompt logprobs (and top-k) of one job from its prefill logits (last C columns)."""
        prompt = job.prompt_tokens
        n = len(prompt)
        start = _first_logprob_position(job)
        # Position i is predicted by the column of position i - 1, i.e. C - (n - i) - 1.
        offset = logits_C_V.shape[0] - n
        values: list[Optional[float]] = [None] * n
        topk: list[Optional[list[tuple[int, float]]]] = [None] * n
        targets = torch.tensor(prompt, device=logits_C_V.device)
        k = job.topk_prompt_logprobs
        for chunk in range(start, n, PROMPT_LOGPROB_CHUNK):
            stop = min(chunk + PROMPT_LOGPROB_CHUNK, n)
            chosen_T, ids_T_k, top_T_k = processing.prompt_logprobs_and_topk(
                logits_C_V[offset + chunk - 1 : offset + stop - 1], targets[chunk:stop], k
            )
            values[chunk:stop] = chosen_T.tolist()
            if ids_T_k is not None:
                for i, (ids, lps) in enumerate(zip(ids_T_k.tolist(), top_T_k.tolist())):
                    topk[chunk + i] = list(zip(ids, lps))
        return (values if job.prompt_logprobs else None), (topk if k > 0 else None)


def by_adapter(pieces: list[Piece], jobs: list[SampleJob]) -> list[Piece]:
    """A wave's pieces grouped by adapter (in order of first use), so each adapter's rows are
    one contiguous run. The sort is stable and a job's pieces share its adapter, so they keep
    their order; each draws from its own job's generator, so no job's draws change."""
    first: dict[Optional[str], int] = {}
    for piece in pieces:
        first.setdefault(jobs[piece.job].adapter, len(first))
    return sorted(pieces, key=lambda piece: first[jobs[piece.job].adapter])


def validate_job(job: SampleJob, files: ModelFiles, eos_token_ids, adapters) -> None:
    """The checks every engine makes on a job before it runs (`adapters`: the loaded keys)."""
    n = len(job.prompt_tokens)
    if n == 0:
        raise InvalidRequest("prompt must contain at least one token")
    vocab = files.vocab_size
    bad = [t for t in job.prompt_tokens if not (0 <= t < vocab)]
    if bad:
        raise InvalidRequest(f"prompt token ids must lie in [0, {vocab}); got {bad[:5]}")
    if not (1 <= job.num_samples <= MAX_NUM_SAMPLES):
        raise InvalidRequest(f"num_samples must be between 1 and {MAX_NUM_SAMPLES}; got {job.num_samples}")
    context = files.max_context
    max_tokens = job.params.max_tokens
    if max_tokens is None and n >= context:
        raise InvalidRequest(f"prompt of {n} tokens leaves no room in the model context of {context}")
    if max_tokens is not None and n + max_tokens > context:
        raise InvalidRequest(
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the model context of {context} tokens"
        )
    k = job.topk_prompt_logprobs
    if not (0 <= k <= min(MAX_TOPK_PROMPT_LOGPROBS, vocab)):
        raise InvalidRequest(f"topk_prompt_logprobs must be between 0 and {MAX_TOPK_PROMPT_LOGPROBS}; got {k}")
    last_n = job.prompt_logprobs_last_n
    if last_n is not None:
        if not (job.prompt_logprobs or k > 0):
            raise InvalidRequest("prompt_logprobs_last_n requires prompt_logprobs")
        if not (1 <= last_n <= n - 1):
            raise InvalidRequest(f"prompt_logprobs_last_n must be between 1 and {n - 1}; got {last_n}")
    prompt_scoring.validate(job, vocab)
    if job.adapter is not None and job.adapter not in adapters:
        raise InvalidRequest(f"adapter {job.adapter!r} is not loaded")
    StopRule.from_params(job.params, eos_token_ids)  # rejects empty stop strings


def _wants_prompt_logprobs(job: SampleJob) -> bool:
    return job.prompt_logprobs or job.topk_prompt_logprobs > 0 or prompt_scoring.wants_prompt_scoring(job)


def _logit_columns(job: SampleJob) -> int:
    """Prefill logit columns the job needs: the last prompt token's, plus one per prompt
    position whose logprob is asked (position i is predicted by column i - 1)."""
    if not _wants_prompt_logprobs(job):
        return 1
    first = len(job.prompt_tokens)
    if job.prompt_logprobs or job.topk_prompt_logprobs > 0:
        first = _first_logprob_position(job)
    scored_row = prompt_scoring.first_scored_row(job)
    if scored_row is not None:
        first = min(first, scored_row + 1)
    return len(job.prompt_tokens) - first + 1


def _first_logprob_position(job: SampleJob) -> int:
    n = len(job.prompt_tokens)
    return 1 if job.prompt_logprobs_last_n is None else n - job.prompt_logprobs_last_n


def _budget(job: SampleJob, max_context: int) -> int:
    if job.params.max_tokens is None:
        return max_context - len(job.prompt_tokens)
    return job.params.max_tokens
