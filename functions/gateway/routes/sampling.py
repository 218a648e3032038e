"""Sampling: sampling sessions, sampler lookup, asample.

As in `training`, a route reads its body on the event loop and does the blocking rest (the
store, the log) in a worker thread, where concurrent requests' appends are group-committed.
"""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Depends, Request

from eventing.store.event_store import Dedup
from functions.compute.weight_sync import MANIFEST
from functions.gateway.context import SOURCE, GatewayContext
from functions.gateway.deps import get_ctx, get_tenant, read_body, require_open_sampler, require_session
from functions.gateway.routes.futures import submitted_key
from functions.gateway.routes.models import resolve_checkpoint
from functions.gateway.sampling_fields import check_prompt_scoring
from functions.gateway.submit import submit
from openrl_core.errors import Gone, InvalidRequest, NotFound
from openrl_core.events import new_event
from openrl_core.events.lifecycle import BlobRef
from openrl_core.events.sampling import SAMPLE, SAMPLING_SESSION_CREATED, SampleRequested, SamplingSessionCreated
from openrl_core.ids import new_request_id, sampling_session_id_for
from openrl_core.params import SamplingParams
from openrl_core.wire.base import UntypedAPIFuture
from openrl_core.wire.sampling import (
    CreateSamplingSessionRequest,
    CreateSamplingSessionResponse,
    GetSamplerResponse,
    SampleRequest,
)

router = APIRouter(prefix="/api/v1")

MAX_NUM_SAMPLES = 128
MAX_TOPK = 64
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


@router.post("/create_sampling_session")
async def create_sampling_session(
    request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> CreateSamplingSessionResponse:
    raw = await read_body(request, ctx.settings.max_request_bytes)
    return await ctx.blocking(_create_sampling_session, ctx, tenant, raw)


def _create_sampling_session(ctx: GatewayContext, tenant: str, raw: bytes) -> CreateSamplingSessionResponse:
    body = CreateSamplingSessionRequest.model_validate_json(raw)
    require_session(ctx, tenant, body.session_id)
    sampling_session_id = sampling_session_id_for(body.session_id, body.sampling_session_seq_id)
    base_model, adapter, weights = body.base_model, None, None
    if body.model_path:
        trained_on, adapter, weights = checkpoint_weights(ctx, tenant, body.model_path)
        if base_model is not None and base_model != trained_on:
            raise InvalidRequest(f"{body.model_path!r} was trained on {trained_on!r}, not {base_model!r}")
        base_model = trained_on
    if base_model is None:
        raise InvalidRequest("create_sampling_session needs a base_model or a model_path")
    ctx.models.catalog.resolve(base_model)
    payload = SamplingSessionCreated(
        sampling_session_id=sampling_session_id,
        session_id=body.session_id,
        sampling_session_seq_id=body.sampling_session_seq_id,
        base_model=base_model,
        model_path=body.model_path,
        adapter=adapter,
        weights=weights,
    )
    event = new_event(SAMPLING_SESSION_CREATED, payload, tenant=tenant, source=SOURCE, key=sampling_session_id)
    ctx.emit(event, dedup=Dedup.of(f"sampler:{sampling_session_id}", raw))
    return CreateSamplingSessionResponse(sampling_session_id=sampling_session_id)


def checkpoint_weights(
    ctx: GatewayContext, tenant: str, model_path: str
) -> tuple[str, Optional[dict[str, BlobRef]], Optional[BlobRef]]:
    """What a sample from the checkpoint at `model_path` runs on: (base model, LoRA adapter
    files, or a full run's published weights manifest). Another tenant's path is NotFound."""
    parsed, _row, run, files = resolve_checkpoint(ctx, tenant, model_path)
    if parsed.kind != "sampler_weights" and not run.is_lora:
        raise InvalidRequest(
            f"{model_path!r} is a full fine-tuning training state; sample from a sampler_weights/ checkpoint "
            "(save_weights_for_sampler) of the run"
        )
    if MANIFEST in files:
        return run.base_model, None, files[MANIFEST]
    return run.base_model, {name: ref for name, ref in files.items() if name in ADAPTER_FILES}, None


@router.get("/samplers/{sampling_session_id}")
def get_sampler(
    sampling_session_id: str, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> GetSamplerResponse:
    row = ctx.projections.sampling_session(tenant, sampling_session_id)
    if row is None:
        raise NotFound(f"unknown sampler {sampling_session_id!r}")
    return GetSamplerResponse(sampler_id=row.sampling_session_id, base_model=row.base_model, model_path=row.model_path)


@router.post("/asample")
async def asample(
    request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> UntypedAPIFuture:
    raw = await read_body(request, ctx.settings.max_request_bytes)
    return await ctx.blocking(_asample, ctx, tenant, raw)


def _asample(ctx: GatewayContext, tenant: str, raw: bytes) -> UntypedAPIFuture:
    body = SampleRequest.model_validate_json(raw)
    if body.sampling_session_id is None:
        raise InvalidRequest("asample needs a sampling_session_id (create one with create_sampling_session)")
    session = ctx.projections.sampling_session(tenant, body.sampling_session_id)
    if session is None:
        raise NotFound(f"unknown sampling_session_id {body.sampling_session_id!r}")
    require_open_sampler(session, body.sampling_session_id)
    _require_weights(ctx, tenant, session)
    files = ctx.models.files(session.base_model)
    prompt = _prompt_tokens(body)
    _validate(body, prompt, files.vocab_size, files.max_context)
    request_id = new_request_id()
    sequence_ids = [f"{request_id}:{i}" for i in range(body.num_samples)]
    payload = SampleRequested(
        request_id=request_id,
        sampling_session_id=session.sampling_session_id,
        seq_id=body.seq_id or 0,
        base_model=session.base_model,
        adapter=session.adapter,
        weights=session.weights,
        run_id=session.run_id,
        prompt_tokens=prompt,
        num_samples=body.num_samples,
        sampling_params=_explicit_budget(body.sampling_params, len(prompt), files.max_context),
        prompt_logprobs=bool(body.prompt_logprobs),
        topk_prompt_logprobs=body.topk_prompt_logprobs,
        prompt_logprobs_last_n=body.prompt_logprobs_last_n,
        topk_sample_logprobs=body.topk_sample_logprobs,
        target_prompt_logprobs=body.target_prompt_logprobs,
        prompt_alt_tokens_k=body.prompt_alt_tokens_k,
        sample_sequence_ids=sequence_ids,
        record_stability_info=bool(body.record_stability_info),
    )
    dedup = Dedup.of(f"sample:{session.sampling_session_id}:{body.seq_id}", raw) if body.seq_id is not None else None
    future = submit(
        ctx,
        tenant,
        SAMPLE["requested"],
        payload,
        stream="sampling",
        base_model=session.base_model,
        key=session.sampling_session_id,
        dedup=dedup,
        sample_sequence_ids=sequence_ids,
    )
    # A retrieve_futures held on this session (on any gateway replica) watches only the
    # samples it knew when it began; this wakes it to watch the new one too.
    ctx.announce([submitted_key(session.sampling_session_id)])
    return future


def _explicit_budget(params: SamplingParams, prompt_tokens: int, max_context: int) -> SamplingParams:
    """No max_tokens means "up to the model's context" (the samplers' own default): written
    into the event as a number, so the event says what the sample is charged against the
    tenant's sampling quota, and the projection can count it without knowing the model."""
    if params.max_tokens is not None:
        return params
    return params.model_copy(update={"max_tokens": max_context - prompt_tokens})


def _prompt_tokens(body: SampleRequest) -> list[int]:
    tokens: list[int] = []
    for index, chunk in enumerate(body.prompt.chunks):
        if chunk.type != "encoded_text":
            raise InvalidRequest(f"prompt.chunks[{index}] is a {chunk.type!r} chunk; only text models are served")
        if chunk.tokens is None:
            raise InvalidRequest(f"prompt.chunks[{index}] is an encoded_text chunk without tokens")
        tokens.extend(chunk.tokens)
    return tokens


def _validate(body: SampleRequest, prompt: list[int], vocab_size: int, max_context: int) -> None:
    if not prompt:
        raise InvalidRequest("prompt holds no tokens")
    bad = next((t for t in prompt if t < 0 or t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"prompt holds token id {bad}, outside the vocabulary [0, {vocab_size})")
    if not 1 <= body.num_samples <= MAX_NUM_SAMPLES:
        raise InvalidRequest(f"num_samples must be between 1 and {MAX_NUM_SAMPLES}, got {body.num_samples}")
    max_tokens = body.sampling_params.max_tokens
    if max_tokens is not None and len(prompt) + max_tokens > max_context:
        raise InvalidRequest(
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the model context of {max_context}"
        )
    if len(prompt) >= max_context:
        raise InvalidRequest(f"prompt of {len(prompt)} tokens leaves no room in the model context of {max_context}")
    if not 0 <= body.topk_prompt_logprobs <= MAX_TOPK:
        raise InvalidRequest(f"topk_prompt_logprobs must be between 0 and {MAX_TOPK}")
    if body.prompt_logprobs_last_n is not None:
        if not body.prompt_logprobs:
            raise InvalidRequest("prompt_logprobs_last_n needs prompt_logprobs=true")
        if not 1 <= body.prompt_logprobs_last_n <= len(prompt) - 1:
            raise InvalidRequest(f"prompt_logprobs_last_n must be between 1 and {len(prompt) - 1}")
    check_prompt_scoring(body, len(prompt), vocab_size, max_context * MAX_TOPK)


def _require_weights(ctx: GatewayContext, tenant: str, session) -> None:
    """A superseded sampler version's weights are collected (`openrl_core.retention`): say so
    with a 410 (the SDK does not retry it) rather than fail the sample in the sampler."""
    refs = list((session.adapter or {}).values()) + ([session.weights] if session.weights else [])
    blobs = ctx.store.codec.blobs
    if blobs is None or all(blobs.exists(tenant, BlobRef.model_validate(ref)) for ref in refs):
        return
    raise Gone(
        f"sampling session {session.sampling_session_id!r} samples superseded weights that are no longer stored "
        f"(a training run keeps its {ctx.settings.sampler_versions_kept} newest sampler versions); sample from a newer "
        "one, or save a named checkpoint (save_weights_for_sampler with a name) to keep weights"
    )
