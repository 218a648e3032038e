"""Training steps: forward_backward (protobuf or JSON), forward (JSON), optim_step, save_weights,
save_weights_for_sampler.

Each route reads its body on the event loop and does the rest (decode, lookups, the store
and the log) in a worker thread: those block, and the appender group-commits the requests
that arrive together only if they wait side by side, not one after another on the loop.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Callable

import zstandard
from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError

from functions.gateway import body_limit, jsonbodies, proto
from functions.gateway.context import GatewayContext
from functions.gateway.deps import get_ctx, get_tenant, read_body, require_run
from functions.gateway.stability import attach_records
from functions.gateway.submit import submit_sequenced, submitting
from openrl_core.datum import DatumRecord, validate_batch
from openrl_core.errors import InvalidRequest, PayloadTooLarge
from openrl_core.events.training import (
    FORWARD_BACKWARD,
    OPTIM_STEP,
    SAVE_WEIGHTS,
    SAVE_WEIGHTS_FOR_SAMPLER,
    ForwardBackwardRequested,
    OptimStepRequested,
    SaveWeightsForSamplerRequested,
    SaveWeightsRequested,
)
from openrl_core.ids import TinkerPath, check_checkpoint_name, sampling_session_id_for
from openrl_core.losses import resolve_config
from openrl_core.params import AdamParams, DimuonParams
from openrl_core.wire.base import UntypedAPIFuture
from openrl_core.wire.training import OptimStepRequest, SaveWeightsForSamplerRequest, SaveWeightsRequest

router = APIRouter(prefix="/api/v1")


async def _body(request: Request, ctx: GatewayContext) -> bytes:
    raw = await read_body(request, ctx.settings.max_request_bytes)
    if request.headers.get("content-encoding", "").lower() == "zstd":
        return _unzstd(raw, ctx.settings.max_request_bytes)
    return raw


def _unzstd(raw: bytes, limit: int) -> bytes:
    """Decompress at most `limit` bytes. Not `decompress(max_output_size=...)`: that bound is
    ignored when the frame header states its size, so a 2 KB body could expand to gigabytes."""
    out, total = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(raw) as reader:
            while chunk := reader.read(1 << 20):
                total += len(chunk)
                if total > limit:
                    raise PayloadTooLarge(
                        f"zstd body decompresses to more than {limit} bytes, over this server's {limit}-byte limit "
                        f"(setting {body_limit.SETTING})"
                    )
                out.append(chunk)
    except zstandard.ZstdError as exc:
        raise InvalidRequest(f"body is not a valid zstd frame: {exc}") from None
    return b"".join(out)


@router.post("/forward_backward")
async def forward_backward(
    request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> UntypedAPIFuture:
    """Protobuf (every SDK since 0.2x with `proto_write_fwdbwd`, always in 0.38) or JSON (older)."""
    raw = await _body(request, ctx)
    return await submitting(ctx, _forward_backward, tenant, raw, request.headers.get("content-type", "").lower())


def _forward_backward(ctx: GatewayContext, tenant: str, raw: bytes, content_type: str) -> UntypedAPIFuture:
    if "protobuf" in content_type:
        message = proto.parse_forward_backward(raw)
        return _submit_forward_backward(
            ctx, tenant, message.model_id, message.seq_id, raw, lambda: proto.decode_forward_backward(message)
        )
    if "json" in content_type:
        envelope = jsonbodies.parse_envelope(raw, "forward_backward")
        return _submit_forward_backward(
            ctx, tenant, envelope.model_id, envelope.seq_id, raw, lambda: jsonbodies.decode(raw, forward_only=False)
        )
    raise InvalidRequest(
        "forward_backward expects an application/x-protobuf ForwardBackwardRequest body "
        "(or, from older SDKs, an application/json one)"
    )


@router.post("/forward")
async def forward(
    request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> UntypedAPIFuture:
    """Older SDKs' TrainingClient.forward: a JSON forward_backward that leaves no gradient.

    Newer ones send `forward_backward` with `forward_only` set instead. Either way it takes a
    seq_id of the model and runs in order with everything else.
    """
    raw = await _body(request, ctx)
    return await submitting(ctx, _forward, tenant, raw)


def _forward(ctx: GatewayContext, tenant: str, raw: bytes) -> UntypedAPIFuture:
    envelope = jsonbodies.parse_envelope(raw, "forward")
    return _submit_forward_backward(
        ctx, tenant, envelope.model_id, envelope.seq_id, raw, lambda: jsonbodies.decode(raw, forward_only=True)
    )


def _submit_forward_backward(
    ctx: GatewayContext,
    tenant: str,
    model_id: str,
    seq_id: int,
    raw: bytes,
    decode: Callable[[], proto.ForwardBackwardCall],
) -> UntypedAPIFuture:
    run = require_run(ctx, tenant, model_id)
    if seq_id < 1:
        raise InvalidRequest(f"seq_id must be at least 1, got {seq_id}")
    files = ctx.models.files(run.base_model)

    def build(request_id: str) -> ForwardBackwardRequested:
        call = decode()
        validate_batch(call.data, call.loss_fn, files.vocab_size, files.max_context)
        data = attach_records(ctx, tenant, run.model_id, call.loss_fn, call.data)
        return ForwardBackwardRequested(
            request_id=request_id,
            model_id=run.model_id,
            seq_id=call.seq_id,
            loss_fn=call.loss_fn,
            loss_fn_config=resolve_config(call.loss_fn, call.loss_fn_config),
            forward_only=call.forward_only,
            data=[DatumRecord.from_datum(datum) for datum in data],
        )

    return submit_sequenced(
        ctx, tenant, run=run, seq_id=seq_id, body=raw, event_type=FORWARD_BACKWARD["requested"], build=build
    )


@router.post("/optim_step")
async def optim_step(
    request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> UntypedAPIFuture:
    raw = await read_body(request, ctx.settings.max_request_bytes)
    return await submitting(ctx, _optim_step, tenant, raw)


def _optim_step(ctx: GatewayContext, tenant: str, raw: bytes) -> UntypedAPIFuture:
    body = OptimStepRequest.model_validate_json(raw)
    run = require_run(ctx, tenant, body.model_id)

    def build(request_id: str) -> OptimStepRequested:
        return OptimStepRequested(
            request_id=request_id,
            model_id=run.model_id,
            seq_id=body.seq_id,
            adam_params=body.adam_params or AdamParams(),
            dimuon_params=dimuon_params(body.optimizer_params),
        )

    return submit_sequenced(
        ctx, tenant, run=run, seq_id=body.seq_id, body=raw, event_type=OPTIM_STEP["requested"], build=build
    )


def dimuon_params(given: dict | None) -> DimuonParams | None:
    """The SDK sends a non-Adam family's step as `optimizer_params` with its `type`."""
    if given is None or given.get("type") in (None, "adamw"):
        return None
    if given.get("type") != "dimuon":
        raise InvalidRequest(f"optimizer {given.get('type')!r} is not offered; send AdamParams or DimuonParams")
    try:
        return DimuonParams.model_validate(given)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise InvalidRequest(f"DimuonParams: {problems}") from None


@router.post("/save_weights")
async def save_weights(
    request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> UntypedAPIFuture:
    raw = await read_body(request, ctx.settings.max_request_bytes)
    return await submitting(ctx, _save_weights, tenant, raw)


def _save_weights(ctx: GatewayContext, tenant: str, raw: bytes) -> UntypedAPIFuture:
    body = SaveWeightsRequest.model_validate_json(raw)
    run = require_run(ctx, tenant, body.model_id)

    def build(request_id: str) -> SaveWeightsRequested:
        if not body.path:
            raise InvalidRequest("save_weights needs a checkpoint name in `path`")
        name = check_checkpoint_name(body.path)
        _refuse_existing(ctx, tenant, TinkerPath(run.model_id, "weights", name), body.overwrite)
        return SaveWeightsRequested(
            request_id=request_id,
            model_id=run.model_id,
            seq_id=body.seq_id,
            name=name,
            ttl_seconds=body.ttl_seconds,
            overwrite=body.overwrite,
            user_metadata=body.user_metadata,
        )

    return submit_sequenced(
        ctx, tenant, run=run, seq_id=body.seq_id, body=raw, event_type=SAVE_WEIGHTS["requested"], build=build
    )


def _refuse_existing(ctx: GatewayContext, tenant: str, path: TinkerPath, overwrite: bool) -> None:
    live = ctx.projections.live_checkpoint(tenant, path.run_id, path.checkpoint_id, datetime.now(timezone.utc))
    if not overwrite and live is not None:
        raise InvalidRequest(f"checkpoint {str(path)!r} already exists; pass overwrite=True to replace it")


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> UntypedAPIFuture:
    raw = await read_body(request, ctx.settings.max_request_bytes)
    return await submitting(ctx, _save_weights_for_sampler, tenant, raw)


def _save_weights_for_sampler(ctx: GatewayContext, tenant: str, raw: bytes) -> UntypedAPIFuture:
    body = SaveWeightsForSamplerRequest.model_validate_json(raw)
    run = require_run(ctx, tenant, body.model_id)

    def build(request_id: str) -> SaveWeightsForSamplerRequested:
        name = sampling_session_id = None
        if body.path:
            # Sampler checkpoints of the same name are replaced, as the cookbook expects.
            name = check_checkpoint_name(body.path)
        elif body.sampling_session_seq_id is not None:
            sampling_session_id = sampling_session_id_for(run.session_id, body.sampling_session_seq_id)
            if ctx.projections.sampling_session(tenant, sampling_session_id) is not None:
                raise InvalidRequest(f"sampling session {sampling_session_id!r} already exists")
        else:
            raise InvalidRequest("save_weights_for_sampler needs a `path` name or a `sampling_session_seq_id`")
        return SaveWeightsForSamplerRequested(
            request_id=request_id,
            model_id=run.model_id,
            seq_id=body.seq_id,
            name=name,
            sampling_session_id=sampling_session_id,
            kind=body.kind,
            ttl_seconds=body.ttl_seconds,
            user_metadata=body.user_metadata,
        )

    return submit_sequenced(
        ctx,
        tenant,
        run=run,
        seq_id=body.seq_id,
        body=raw,
        event_type=SAVE_WEIGHTS_FOR_SAMPLER["requested"],
        build=build,
    )
