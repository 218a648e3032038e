"""Checkpoint records: list, delete, publish/unpublish, set TTL, copy_weights, and the reaper.

Routing: the SDK inserts checkpoint ids unescaped, and they hold a '/' (`weights/final`),
so each method has one catch-all route under `/training_runs/{run_id}/checkpoints/` that
splits the rest itself. A checkpoint id is always exactly `<kind>/<name>`, so the split is
unambiguous even for a checkpoint named `publish` or `ttl`: two segments are a checkpoint,
three are a checkpoint and an action. Ids are checked by `TinkerPath` (no '..', no extra
segments, known kinds only) before any lookup.

Semantics:
- Only live checkpoints exist here: one past its `expires_at` is a 404 at once, before the
  reaper has removed it.
- publish / unpublish set the record's `public` flag. This server shares nothing across
  tenants, so the flag is recorded and reported but grants no one else access. Setting the
  value it already has answers 204 and records nothing. The SDK documents a 409 there, but
  its RestClient retries a 409 for five minutes (`_is_retryable_status_code`), so a 409
  would turn a retried publish whose first answer was lost into a five-minute hang.
- ttl: `{"ttl_seconds": n}` makes the checkpoint expire n seconds from now (1 hour to 10
  years, as the SDK documents); `{"ttl_seconds": null}` makes it never expire.
- DELETE, and the reaper for an expired checkpoint, emit the removal (`checkpoint.delete`
  or `checkpoint.expire`), whose projection drops the record; then the blobs go, only those
  that no remaining checkpoint record or sampling session references: blobs are
  content-addressed, so a copy, or a sampler save and a state save made at the same step,
  share them. A sampling session made from a deleted checkpoint keeps sampling.
- The reaper is a plain function, `reap_expired(ctx, now)`, that tests call, and a loop,
  `Reaper(ctx, interval).run(stop)`, that `openrl serve` runs in a thread. Two reapers
  racing (two gateway replicas) both emit an expiry; the second finds no record and
  changes nothing. Known gap: a save whose blob is byte-identical to one being collected
  can lose it if the trainer writes it (a no-op, the file exists) in the milliseconds
  between the collector's reference check and its unlink.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from datetime import datetime, timedelta, timezone
from typing import Iterable, Optional

from fastapi import APIRouter, Depends, Request, Response

from eventing.blobs import BlobStore
from eventing.store.event_store import Dedup
from eventing.store.projections import utc
from functions.compute.weight_sync import session_files
from functions.gateway import quotas
from functions.gateway.context import SOURCE, GatewayContext
from functions.gateway.deps import get_ctx, get_tenant, read_body, require_session
from functions.gateway.routes.rest_wire import (
    CheckpointsListResponse,
    CopyWeightsRequest,
    CopyWeightsResponse,
    TtlRequest,
    check_page,
    check_ttl,
    checkpoint_of,
    cursor,
)
from functions.periodic import Periodic
from openrl_core.errors import Conflict, InvalidRequest, NotFound
from openrl_core.events import new_event
from openrl_core.events.checkpoints import (
    CHECKPOINT_COPIED,
    CHECKPOINT_DELETED,
    CHECKPOINT_EXPIRED,
    CHECKPOINT_PUBLISHED,
    CHECKPOINT_TTL_SET,
    CHECKPOINT_UNPUBLISHED,
    CheckpointCopied,
    CheckpointRemoved,
    CheckpointTtlSet,
    CheckpointVisibility,
)
from openrl_core.events.lifecycle import BlobRef, CheckpointSaved
from openrl_core.ids import TinkerPath, model_id_for, new_request_id, new_uuid
from openrl_core.params import LoraConfig
from openrl_core.quotas import Cost

log = logging.getLogger(__name__)
router = APIRouter(prefix="/api/v1")
PREFIX = "/training_runs/{run_id}/checkpoints/{rest:path}"
# Project-form copies name their new session from the SDK's idempotency key, so a retried
# copy lands on the same path instead of making a second copy.
COPY_NAMESPACE = uuid.UUID("6f1d3c52-9b3e-4d0e-8a7e-2f4b6c1e9a10")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def require_live_checkpoint(ctx: GatewayContext, tenant: str, path: TinkerPath, now: datetime):
    row = ctx.projections.live_checkpoint(tenant, path.run_id, path.checkpoint_id, now)
    if row is None:
        raise NotFound(f"checkpoint {str(path)!r} not found")
    return row


def split_action(run_id: str, rest: str, actions: tuple[Optional[str], ...]) -> tuple[TinkerPath, Optional[str]]:
    """`weights/x` -> (path, None); `weights/x/<action>` -> (path, action); None in `actions`
    allows the bare checkpoint. Any other shape is a 404 (no such route) or a 400."""
    parts = rest.split("/")
    if len(parts) == 3 and parts[2] in actions:
        return TinkerPath.from_checkpoint_id(run_id, "/".join(parts[:2])), parts[2]
    if len(parts) == 2 and None in actions:
        return TinkerPath.from_checkpoint_id(run_id, rest), None
    if len(parts) in (2, 3):
        expected = " or ".join(f"<kind>/<name>/{a}" if a else "<kind>/<name>" for a in actions)
        raise NotFound(f"no route for checkpoints/{rest}: this method takes {expected}")
    raise InvalidRequest(f"checkpoint id {rest!r} must be <kind>/<name>, e.g. weights/final")


@router.get("/training_runs/{run_id}/checkpoints")
def list_checkpoints(
    run_id: str, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> CheckpointsListResponse:
    if ctx.projections.run(tenant, run_id) is None:
        raise NotFound(f"unknown training run {run_id!r}")
    rows, _ = ctx.projections.live_checkpoints(tenant, utcnow(), run_id=run_id)
    return CheckpointsListResponse(checkpoints=[checkpoint_of(row) for row in rows])


@router.get("/checkpoints")
def list_user_checkpoints(
    limit: int = 100, offset: int = 0, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> CheckpointsListResponse:
    check_page(limit, offset)
    rows, total = ctx.projections.live_checkpoints(tenant, utcnow(), limit=limit, offset=offset)
    return CheckpointsListResponse(
        checkpoints=[checkpoint_of(row) for row in rows], cursor=cursor(offset, limit, total)
    )


@router.delete(PREFIX, status_code=204)
def delete_or_unpublish(
    run_id: str, rest: str, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> Response:
    path, action = split_action(run_id, rest, (None, "publish"))
    row = require_live_checkpoint(ctx, tenant, path, utcnow())
    if action is None:
        remove_checkpoint(ctx, tenant, row)
    else:
        _set_public(ctx, tenant, path, row, public=False)
    return Response(status_code=204)


@router.post(PREFIX, status_code=204)
def publish(
    run_id: str, rest: str, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> Response:
    path, _ = split_action(run_id, rest, ("publish",))
    _set_public(ctx, tenant, path, require_live_checkpoint(ctx, tenant, path, utcnow()), public=True)
    return Response(status_code=204)


def _set_public(ctx: GatewayContext, tenant: str, path: TinkerPath, row, public: bool) -> None:
    if bool(row.public) == public:
        return
    payload = CheckpointVisibility(run_id=path.run_id, checkpoint_id=path.checkpoint_id)
    type_ = CHECKPOINT_PUBLISHED if public else CHECKPOINT_UNPUBLISHED
    ctx.emit(new_event(type_, payload, tenant=tenant, source=SOURCE, key=path.run_id, subject=str(path)))


@router.put(PREFIX, status_code=204)
def set_ttl(
    run_id: str, rest: str, body: TtlRequest, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> Response:
    path, _ = split_action(run_id, rest, ("ttl",))
    ttl_seconds = check_ttl(body.ttl_seconds)
    now = utcnow()
    require_live_checkpoint(ctx, tenant, path, now)
    expires_at = now + timedelta(seconds=ttl_seconds) if ttl_seconds is not None else None
    payload = CheckpointTtlSet(
        run_id=path.run_id, checkpoint_id=path.checkpoint_id, ttl_seconds=ttl_seconds, expires_at=expires_at
    )
    ctx.emit(new_event(CHECKPOINT_TTL_SET, payload, tenant=tenant, source=SOURCE, key=path.run_id, subject=str(path)))
    return Response(status_code=204)


@router.post("/copy_weights")
async def copy_weights(
    request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> CopyWeightsResponse:
    """Copy a checkpoint record under a new training run; the blobs are shared, not copied.

    - The copy keeps the source's kind and name: `tinker://<new run>/<kind>/<name>`, with
      the source's files, size and user_metadata. Its expiry is `ttl_seconds` from now (1 hour
      to 10 years) or never; the source's expiry is not inherited. It starts private.
    - `session_id` + `model_seq_id`: the new run is `<session_id>:train:<model_seq_id>` in
      that (own, existing) session. The slot must be unused: it is taken exactly as
      create_model would take it, so a later create_model on it is a 409, as is a copy into
      a slot a model already holds.
    - `destination_project_id`: the new run is `<new session>:train:0`, where the new
      session (in that project, already finished) exists only to hold the copy.
    - The new run has the source run's base model, LoRA config and user_metadata, and
      cannot be trained (no trainer holds an adapter for it). It can be loaded from
      (`create_training_client_from_state`), sampled from, exported and deleted like any
      checkpoint. Deleting the source leaves the copy whole (shared blobs stay while any
      record references them).
    - A retry with the SDK's X-Idempotency-Key (or, in the session form, the same body)
      answers the first copy's path and copies nothing again.
    """
    raw = await read_body(request, ctx.settings.max_request_bytes)
    body = CopyWeightsRequest.model_validate_json(raw)
    if body.weights_access_token is not None:
        raise InvalidRequest("weights_access_token is not supported: copies stay within the caller's own checkpoints")
    ttl_seconds = check_ttl(body.ttl_seconds)
    source = TinkerPath.parse(body.source_path)
    now = utcnow()
    row = require_live_checkpoint(ctx, tenant, source, now)
    run = ctx.projections.run(tenant, source.run_id)
    if run is None:
        raise NotFound(f"checkpoint {str(source)!r} not found")
    session_id, project_id, dedup = _destination(ctx, tenant, body, raw, request.headers.get("x-idempotency-key"))
    checkpoint = CheckpointSaved(
        run_id=model_id_for(session_id, body.model_seq_id or 0),
        kind=source.kind,
        name=source.name,
        files={name: BlobRef.model_validate(ref) for name, ref in row.files.items()},
        expires_at=now + timedelta(seconds=ttl_seconds) if ttl_seconds is not None else None,
        user_metadata=row.user_metadata,
    )
    payload = CheckpointCopied(
        request_id=new_request_id(),
        source_path=str(source),
        checkpoint=checkpoint,
        session_id=session_id,
        base_model=run.base_model,
        lora_config=LoraConfig.model_validate(run.lora_config) if run.is_lora else None,
        full_finetune=not run.is_lora,
        user_metadata=run.user_metadata,
        destination="project" if project_id is not None else "session",
        new_session_project_id=project_id,
    )
    event = new_event(
        CHECKPOINT_COPIED, payload, tenant=tenant, source=SOURCE, key=checkpoint.run_id, subject=checkpoint.tinker_path
    )
    # A copy's bytes are known now: it must fit the tenant's storage quota whole.
    with quotas.admitted(ctx, tenant, Cost(checkpoint_bytes=int(row.size_bytes)), dedup):
        ctx.emit(event, dedup=dedup)
    return CopyWeightsResponse(tinker_path=checkpoint.tinker_path)


def _destination(
    ctx: GatewayContext, tenant: str, body: CopyWeightsRequest, raw: bytes, idempotency_key: Optional[str]
) -> tuple[str, Optional[str], Optional[Dedup]]:
    """(session id, project id of a new session or None, dedup) for the copy's new run."""
    if (body.session_id is None) != (body.model_seq_id is None):
        raise InvalidRequest("copy_weights needs session_id and model_seq_id together")
    if body.session_id is not None:
        if body.destination_project_id is not None:
            raise InvalidRequest(
                "copy_weights takes a destination_project_id or a session_id with model_seq_id, not both"
            )
        require_session(ctx, tenant, body.session_id)
        run_id = model_id_for(body.session_id, body.model_seq_id)
        existing = ctx.projections.run(tenant, run_id)
        if existing is not None and existing.state != "frozen":
            raise Conflict(f"training run {run_id!r} already exists; copy into an unused model_seq_id")
        # The create_model key of that slot: the same copy again is a retry, anything else a 409.
        return body.session_id, None, Dedup.of(f"model:{body.session_id}:{body.model_seq_id}", raw)
    project_id = (body.destination_project_id or "").strip()
    if not project_id:
        raise InvalidRequest("copy_weights needs a destination_project_id, or a session_id and model_seq_id")
    if len(project_id) > 200:
        raise InvalidRequest("destination_project_id must be at most 200 characters")
    if idempotency_key:
        key_hash = hashlib.sha256(idempotency_key.encode()).hexdigest()
        return str(uuid.uuid5(COPY_NAMESPACE, f"{tenant}\n{key_hash}")), project_id, Dedup.of(f"copy:{key_hash}", raw)
    return new_uuid(), project_id, None


# -- removal and the reaper ----------------------------------------------------------------


def blobs_of(ctx: GatewayContext) -> BlobStore:
    blobs = ctx.store.codec.blobs
    if blobs is None:
        raise RuntimeError("the event store's codec has no blob store")
    return blobs


def remove_checkpoint(ctx: GatewayContext, tenant: str, row, *, expired: bool = False) -> list[str]:
    """Emit the removal of one checkpoint record, then free its unshared blobs; returns their hashes."""
    files = {name: BlobRef.model_validate(ref) for name, ref in row.files.items()}
    payload = CheckpointRemoved(
        run_id=row.run_id, checkpoint_id=row.checkpoint_id, files=files, expires_at=utc(row.expires_at)
    )
    type_ = CHECKPOINT_EXPIRED if expired else CHECKPOINT_DELETED
    ctx.emit(new_event(type_, payload, tenant=tenant, source=SOURCE, key=row.run_id, subject=row.tinker_path))
    return collect_blobs(ctx, tenant, files.values())


def collect_blobs(ctx: GatewayContext, tenant: str, refs: Iterable[BlobRef]) -> list[str]:
    """Delete the blobs among `refs` that nothing in the projections references any more.

    A live full run's sampling session names only its manifest; the chain files the manifest
    names (which a checkpoint of the same run shares) count as referenced too."""
    blobs = blobs_of(ctx)
    in_use = ctx.projections.referenced_blobs(tenant)
    for row in ctx.projections.live_samplers(tenant, ctx.settings.sampler_versions_kept):
        if row.weights is not None:
            in_use |= session_files(lambda ref: blobs.get(tenant, ref), None, row.weights)
    freed = []
    for digest in sorted({ref.sha256 for ref in refs} - in_use):
        blobs.delete(tenant, BlobRef(sha256=digest, size=0))
        freed.append(digest)
    return freed


def reap_expired(ctx: GatewayContext, now: Optional[datetime] = None, batch: int = 500) -> list[str]:
    """Remove every checkpoint whose expiry is at or before `now`; returns their tinker paths."""
    now = now or utcnow()
    removed: list[str] = []
    seen: set[str] = set()
    while True:
        rows = [row for row in ctx.projections.expired_checkpoints(now, limit=batch) if row.tinker_path not in seen]
        for row in rows:
            remove_checkpoint(ctx, row.tenant, row, expired=True)
            removed.append(row.tinker_path)
            seen.add(row.tinker_path)
        if len(rows) < batch:  # also ends a pass that made no progress
            return removed


class Reaper(Periodic):
    """Runs `reap_expired` now and then every `interval_seconds` until `stop` is set."""

    def __init__(self, ctx: GatewayContext, interval_seconds: float) -> None:
        self.ctx = ctx
        super().__init__("reaper", self._reap, interval_seconds)

    def _reap(self) -> Optional[str]:
        removed = reap_expired(self.ctx)
        return f"{len(removed)} expired checkpoint(s) removed" if removed else None
