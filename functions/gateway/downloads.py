"""External weights: save_weights_external, its expiring download links, and serving them.

`save_weights_external` is a sequenced training request like save_weights: the trainer
applies it at its seq_id and stores the adapter as plain PEFT files,
`adapter_model.safetensors` (keys `base_model.model.<module path>.lora_{A,B}.weight`) and
`adapter_config.json`, in an `external_weights/<name>` checkpoint. A same-named export is
replaced, as sampler checkpoints are. With `age_encryption_recipients` every file is stored
age-encrypted to those keys as `<name>.age` (`functions.compute.age_export`, pyrage), and
the links below serve that ciphertext; a key age does not accept is a 400 before anything
is stored.

`external_weights_urls` answers one link per file, valid for `download_link_seconds` or
until the checkpoint expires, whichever is first. A link names a tenant, a blob hash and an
expiry (unix seconds), and carries an HMAC-SHA256 of exactly those three under a server
secret. The download route needs no API key, because the SDK's CLI and tinker-cookbook
fetch each URL with a plain `urllib` GET; the signature is the authorisation. A wrong or
missing signature is a 403, a past expiry a 410, a blob no longer stored (no checkpoint
holds it any more) a 410. The secret is `settings.download_secret` when set (replicas
behind one URL must share it), else a random key created once in `data_dir/download-secret`
(mode 0600), so links survive a restart of the same deployment and verify nowhere else.

Using the files: `PeftModel.from_pretrained(base, dir)` reproduces the server's logits.
To `merge_and_unload()` into a base whose lm_head is tied to its input embeddings (tiny
Qwen3, small Qwen3 models), untie it first, as PEFT warns: merging the lm_head LoRA into a
tied weight would change the embeddings too.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterator
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from eventing.store.projections import utc
from functions.compute.age_export import parse_recipients
from functions.gateway.context import GatewayContext
from functions.gateway.deps import get_ctx, get_tenant, read_body, require_run
from functions.gateway.routes.checkpoints import require_live_checkpoint, split_action, utcnow
from functions.gateway.routes.rest_wire import ExternalWeightsUrlsResponse, SaveWeightsExternalRequest
from functions.gateway.submit import submit_sequenced
from openrl_core.errors import Gone, InvalidRequest
from openrl_core.events.lifecycle import BlobRef
from openrl_core.events.training import SAVE_WEIGHTS_EXTERNAL, SaveWeightsExternalRequested
from openrl_core.ids import check_checkpoint_name
from openrl_core.settings import Settings
from openrl_core.wire.base import UntypedAPIFuture

router = APIRouter(prefix="/api/v1")
CHUNK = 1 << 20

SECRET_FILE = "download-secret"
_SHA256 = re.compile(r"[0-9a-f]{64}")  # fullmatch: `$` would let a final newline through
_TENANT = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")
_secrets: dict[Path, bytes] = {}


def server_secret(settings: Settings) -> bytes:
    if settings.download_secret is not None:
        return settings.download_secret.get_secret_value().encode()
    path = (settings.data_dir / SECRET_FILE).resolve()
    if path not in _secrets:
        try:
            # O_EXCL: of two processes starting on one data dir, one writes and both read it.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_hex(32))
        key = path.read_text().strip()
        if len(key) < 32:
            raise RuntimeError(f"{path} holds no usable download secret; delete it to make a new one")
        _secrets[path] = key.encode()
    return _secrets[path]


def signature(secret: bytes, tenant: str, sha256: str, expires: int) -> str:
    return hmac.new(secret, f"{tenant}\n{sha256}\n{expires}".encode(), hashlib.sha256).hexdigest()


def link(base_url: str, secret: bytes, tenant: str, ref: BlobRef, filename: str, expires: int) -> str:
    """The URL of one file; `filename` only names the download, the signature covers the blob."""
    query = urlencode({"expires": expires, "signature": signature(secret, tenant, ref.sha256, expires)})
    return f"{base_url.rstrip('/')}/api/v1/downloads/{tenant}/{ref.sha256}/{quote(filename, safe='')}?{query}"


def base_url(ctx: GatewayContext, request: Request) -> str:
    return ctx.settings.public_url or str(request.base_url)


def _forbidden(detail: str) -> HTTPException:
    return HTTPException(status_code=403, detail=detail)


@router.post("/save_weights_external")
async def save_weights_external(
    request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> UntypedAPIFuture:
    raw = await read_body(request, ctx.settings.max_request_bytes)
    body = SaveWeightsExternalRequest.model_validate_json(raw)
    run = require_run(ctx, tenant, body.model_id)
    if body.seq_id is None:
        raise InvalidRequest(
            "save_weights_external needs the model's next seq_id: it is applied in order with training"
        )

    def build(request_id: str) -> SaveWeightsExternalRequested:
        if run.state == "frozen":
            raise InvalidRequest(
                f"{run.model_id!r} holds a copy made by copy_weights; export its checkpoint from a "
                "training client made with create_training_client_from_state"
            )
        if not body.path:
            raise InvalidRequest("save_weights_external needs a name for the export in `path`")
        name = check_checkpoint_name(body.path)
        recipients = body.age_encryption_recipients
        if recipients is not None:
            parse_recipients(recipients)  # a bad key is a 400 here, before anything is stored
        return SaveWeightsExternalRequested(
            request_id=request_id, model_id=run.model_id, seq_id=body.seq_id, name=name, ttl_seconds=body.ttl_seconds,
            age_encryption_recipients=recipients,
        )  # fmt: skip

    return submit_sequenced(
        ctx, tenant, run=run, seq_id=body.seq_id, body=raw, event_type=SAVE_WEIGHTS_EXTERNAL["requested"], build=build
    )


@router.get("/training_runs/{run_id}/checkpoints/{rest:path}")
def external_weights_urls(
    run_id: str, rest: str, request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> ExternalWeightsUrlsResponse:
    path, _ = split_action(run_id, rest, ("external_weights_urls",))
    if path.kind != "external_weights":
        raise InvalidRequest(
            f"{str(path)!r} is a {path.kind} checkpoint; only external_weights checkpoints have download links "
            "(export one with save_weights_external)"
        )
    now = utcnow()
    row = require_live_checkpoint(ctx, tenant, path, now)
    expires = now + timedelta(seconds=ctx.settings.download_link_seconds)
    if row.expires_at is not None:
        expires = min(expires, utc(row.expires_at))
    expires_unix = int(expires.timestamp())
    secret, base = server_secret(ctx.settings), base_url(ctx, request)
    urls = {
        name: link(base, secret, tenant, BlobRef.model_validate(ref), name, expires_unix)
        for name, ref in sorted(row.files.items())
    }
    return ExternalWeightsUrlsResponse(urls=urls, expires=expires.replace(microsecond=0))


@router.get("/downloads/{tenant}/{sha256}/{filename}")
def download(
    tenant: str,
    sha256: str,
    filename: str,
    expires: str = "",
    given: str = Query("", alias="signature"),
    ctx: GatewayContext = Depends(get_ctx),
) -> StreamingResponse:
    if not expires or not given:
        raise _forbidden("download link lacks its expires and signature parameters")
    if not (expires.isascii() and expires.isdigit()) or not _TENANT.fullmatch(tenant) or not _SHA256.fullmatch(sha256):
        raise _forbidden("download link is malformed")
    expected = signature(server_secret(ctx.settings), tenant, sha256, int(expires))
    # compared as bytes: compare_digest refuses str with non-ASCII characters (a TypeError, once a 500)
    if not hmac.compare_digest(expected.encode(), given.encode("utf-8", "surrogatepass")):
        raise _forbidden("download link signature does not match: the link was altered or comes from another server")
    if int(expires) <= datetime.now(timezone.utc).timestamp():
        expired_at = datetime.fromtimestamp(int(expires), timezone.utc).isoformat()
        raise Gone(f"download link expired at {expired_at}; ask external_weights_urls for fresh links")
    # BlobStore keeps its layout private; a streamed file needs the path, not the bytes.
    # Opened before the answer starts: a file deleted while it streams still reads whole,
    # and the declared length makes any shorter answer an error at the client.
    try:
        handle = open(ctx.store.codec.blobs._path(tenant, sha256), "rb")
    except FileNotFoundError:
        raise Gone("this file is no longer stored: its checkpoint was deleted or expired") from None
    size = os.fstat(handle.fileno()).st_size

    def stream() -> Iterator[bytes]:
        try:
            while chunk := handle.read(CHUNK):
                yield chunk
        finally:
            handle.close()

    quoted = quote(filename)  # as Starlette's FileResponse names it
    disposition = (
        f"attachment; filename*=utf-8''{quoted}" if quoted != filename else f'attachment; filename="{filename}"'
    )
    headers = {"Content-Length": str(size), "Content-Disposition": disposition}
    return StreamingResponse(
        stream(), media_type="application/octet-stream", headers=headers, background=BackgroundTask(handle.close)
    )
