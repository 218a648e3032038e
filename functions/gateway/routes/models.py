"""Training models: create_model, get_info, load_weights (create-via-load and in place)."""

from __future__ import annotations

from datetime import datetime, timezone

from fastapi import APIRouter, Depends, Request

from eventing.store.event_store import Dedup
from functions.gateway.context import GatewayContext
from functions.gateway.deps import get_ctx, get_tenant, read_body, require_run, require_session
from functions.gateway.submit import submit, submit_sequenced, submitting, training_stream
from openrl_core.errors import InvalidRequest, NotFound
from openrl_core.events.lifecycle import BlobRef
from openrl_core.events.training import CREATE_MODEL, LOAD_WEIGHTS, CreateModelRequested, LoadWeightsRequested
from openrl_core.finetune import FULL_FINETUNE_KEY, check_full_finetune_config, is_full_finetune
from openrl_core.ids import TinkerPath, model_id_for, new_request_id
from openrl_core.params import ADAMW, LoraConfig, check_optimizer_config
from openrl_core.wire.base import UntypedAPIFuture
from openrl_core.wire.training import CreateModelRequest, GetInfoRequest, GetInfoResponse, LoadWeightsRequest, ModelData

router = APIRouter(prefix="/api/v1")


def _check_optimizer(config: dict | None, full: bool = False) -> dict:
    try:
        checked = check_optimizer_config(config)
    except ValueError as error:
        raise InvalidRequest(str(error)) from None
    if full and checked["type"] != ADAMW:
        raise InvalidRequest("the Dimuon optimizer is offered for LoRA training; full fine-tuning trains with 'adamw'")
    return checked


@router.post("/create_model")
async def create_model(
    request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> UntypedAPIFuture:
    raw = await read_body(request, ctx.settings.max_request_bytes)
    return await submitting(ctx, _create_model, tenant, raw)


def _create_model(ctx: GatewayContext, tenant: str, raw: bytes) -> UntypedAPIFuture:
    body = CreateModelRequest.model_validate_json(raw)
    require_session(ctx, tenant, body.session_id)
    ctx.models.catalog.resolve(body.base_model)
    full = is_full_finetune(body.base_model, body.user_metadata, ctx.settings.full_finetune_models)
    if full:
        check_full_finetune_config(body.lora_config)
    elif body.lora_config is None:
        raise InvalidRequest(
            f"lora_config is required for a LoRA run (for full fine-tuning set user_metadata {{{FULL_FINETUNE_KEY!r}: 'true'}})"
        )
    model_id = model_id_for(body.session_id, body.model_seq_id)
    payload = CreateModelRequested(
        request_id=new_request_id(),
        session_id=body.session_id,
        model_id=model_id,
        model_seq_id=body.model_seq_id,
        base_model=body.base_model,
        # a full run may come without one (its description says so): the event keeps a placeholder
        lora_config=body.lora_config or LoraConfig(),
        user_metadata=body.user_metadata,
        optimizer_config=_check_optimizer(body.optimizer_config, full),
        full_finetune=full,
    )
    dedup = Dedup.of(f"model:{body.session_id}:{body.model_seq_id}", raw)
    return submit(
        ctx,
        tenant,
        CREATE_MODEL["requested"],
        payload,
        stream=training_stream(full),
        base_model=body.base_model,
        key=model_id,
        dedup=dedup,
        model_id=model_id,
    )


@router.post("/get_info")
def get_info(
    body: GetInfoRequest, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> GetInfoResponse:
    run = require_run(ctx, tenant, body.model_id)
    files = ctx.models.files(run.base_model)
    return GetInfoResponse(
        model_data=ModelData(arch=files.arch, model_name=run.base_model, tokenizer_id=str(files.tokenizer_dir)),
        model_id=run.model_id,
        is_lora=bool(run.is_lora),
        lora_rank=run.lora_rank if run.is_lora else None,
        model_name=run.base_model,
    )


def resolve_checkpoint(ctx: GatewayContext, tenant: str, path: str):
    parsed = TinkerPath.parse(path)
    # Expired checkpoints are gone for readers at once, before the reaper deletes them.
    row = ctx.projections.live_checkpoint(tenant, parsed.run_id, parsed.checkpoint_id, datetime.now(timezone.utc))
    if row is None:
        raise NotFound(f"checkpoint {path!r} not found")
    run = ctx.projections.run(tenant, parsed.run_id)
    if run is None:
        raise NotFound(f"checkpoint {path!r} not found")
    files = {name: BlobRef.model_validate(ref) for name, ref in row.files.items()}
    return parsed, row, run, files


@router.post("/load_weights")
async def load_weights(
    request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> UntypedAPIFuture:
    raw = await read_body(request, ctx.settings.max_request_bytes)
    return await submitting(ctx, _load_weights, tenant, raw)


def _load_weights(ctx: GatewayContext, tenant: str, raw: bytes) -> UntypedAPIFuture:
    body = LoadWeightsRequest.model_validate_json(raw)
    if body.session_id is not None and body.model_seq_id is not None:
        return _create_via_load(ctx, tenant, body, raw)
    if body.model_id is None or body.seq_id is None:
        raise InvalidRequest("load_weights needs either session_id and model_seq_id, or model_id and seq_id")
    run = require_run(ctx, tenant, body.model_id)

    def build(request_id: str) -> LoadWeightsRequested:
        parsed, _row, source_run, files = resolve_checkpoint(ctx, tenant, body.path)
        _check_loadable(parsed, body.optimizer)
        if source_run.base_model != run.base_model:
            raise InvalidRequest(f"checkpoint is for {source_run.base_model!r}, this model is {run.base_model!r}")
        _check_same_kind(source_run, run)
        return LoadWeightsRequested(
            request_id=request_id,
            model_id=run.model_id,
            seq_id=body.seq_id,
            path=body.path,
            files=files,
            with_optimizer=body.optimizer,
        )

    return submit_sequenced(
        ctx, tenant, run=run, seq_id=body.seq_id, body=raw, event_type=LOAD_WEIGHTS["requested"], build=build
    )


def _check_same_kind(source_run, run) -> None:
    if bool(source_run.is_lora) != bool(run.is_lora):
        kinds = {True: "a LoRA adapter", False: "a full fine-tuning run"}
        raise InvalidRequest(
            f"the checkpoint holds {kinds[bool(source_run.is_lora)]}'s weights; model {run.model_id!r} is {kinds[bool(run.is_lora)]}"
        )


def _check_loadable(parsed: TinkerPath, with_optimizer: bool) -> None:
    if parsed.kind == "external_weights":
        raise InvalidRequest("external_weights checkpoints are exports and cannot be loaded; use a weights/ path")
    if with_optimizer and parsed.kind != "weights":
        raise InvalidRequest(
            "optimizer state is only saved in weights/ checkpoints (save_state), not in sampler_weights/"
        )


def _create_via_load(ctx: GatewayContext, tenant: str, body: LoadWeightsRequest, raw: bytes) -> UntypedAPIFuture:
    require_session(ctx, tenant, body.session_id)
    parsed, _row, source_run, files = resolve_checkpoint(ctx, tenant, body.path)
    _check_loadable(parsed, body.optimizer)
    base_model = body.base_model or source_run.base_model
    if base_model != source_run.base_model:
        raise InvalidRequest(f"checkpoint {body.path!r} was trained on {source_run.base_model!r}, not {base_model!r}")
    model_id = model_id_for(body.session_id, body.model_seq_id)
    full = not source_run.is_lora  # a run made from a checkpoint is of the checkpoint's kind
    payload = LoadWeightsRequested(
        request_id=new_request_id(),
        model_id=model_id,
        path=body.path,
        files=files,
        with_optimizer=body.optimizer,
        session_id=body.session_id,
        base_model=base_model,
        lora_config=None if full else LoraConfig.model_validate(source_run.lora_config),
        user_metadata=body.user_metadata if body.user_metadata is not None else source_run.user_metadata,
        full_finetune=full,
        # With the optimizer, the checkpoint's state decides the optimizer (and its family).
        optimizer_config=None if body.optimizer else _check_optimizer(body.optimizer_config, full),
    )
    dedup = Dedup.of(f"model:{body.session_id}:{body.model_seq_id}", raw)
    return submit(
        ctx,
        tenant,
        LOAD_WEIGHTS["requested"],
        payload,
        stream=training_stream(full),
        base_model=base_model,
        key=model_id,
        dedup=dedup,
        model_id=model_id,
    )
