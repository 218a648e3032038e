"""The OpenRL API's checkpoints and sessions: list, download as one archive, delete.

Same rules as `openrl_runs`: `/api/openrl/v1`, a `schema` field in every JSON answer, a
tenant sees its own objects and the operator every tenant's, another tenant's object is a
404 like one that does not exist.

The archive of a checkpoint is an uncompressed tar of its files, streamed: members in
name order, each with the checkpoint's creation time, mode 0644 and no owner, so the same
checkpoint always gives the same bytes (`openrl checkpoints download` writes exactly these
bytes). A path is given as `?path=tinker://<run>/<kind>/<name>` and checked by `TinkerPath`.
Every member file is opened before the answer starts, and the answer declares its length:
a checkpoint deleted (its blobs unlinked) while it is being downloaded still streams whole
from the open files, and an archive cut short for any other reason is shorter than its
Content-Length, which every HTTP client reports as an error, never as a complete download.
Deleting goes through the same removal as Tinker's DELETE (an event, then the blobs that
nothing else references).
"""

from __future__ import annotations

import os
import tarfile
from typing import BinaryIO, Iterator, Optional

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from eventing.store.projections import utc
from eventing.store.run_views import RunViews
from functions.gateway.context import GatewayContext
from functions.gateway.deps import Caller, get_caller, get_ctx
from functions.gateway.routes.checkpoints import blobs_of, remove_checkpoint, utcnow
from functions.gateway.routes.openrl_runs import PREFIX, check_limits, checkpoint_json, iso, require_visible_run, views
from openrl_core.errors import Gone, NotFound
from openrl_core.ids import TinkerPath

router = APIRouter(prefix=PREFIX)
CHUNK = 1 << 20


def _visible_checkpoint(ctx: GatewayContext, caller: Caller, path: str):
    parsed = TinkerPath.parse(path)
    for row in views(ctx).checkpoints(caller.tenant, utcnow(), run_id=parsed.run_id):
        if row.checkpoint_id == parsed.checkpoint_id:
            return row
    raise NotFound(f"checkpoint {path!r} not found")


@router.get("/checkpoints")
def list_checkpoints(
    run_id: Optional[str] = None, ctx: GatewayContext = Depends(get_ctx), caller: Caller = Depends(get_caller)
) -> dict:
    if run_id is not None:
        require_visible_run(ctx, caller, run_id)
    rows = views(ctx).checkpoints(caller.tenant, utcnow(), run_id=run_id)
    return {"schema": "openrl.checkpoints.v1", "checkpoints": [checkpoint_json(row) for row in rows]}


@router.get("/checkpoints/archive")
def checkpoint_archive(
    path: str, ctx: GatewayContext = Depends(get_ctx), caller: Caller = Depends(get_caller)
) -> StreamingResponse:
    row = _visible_checkpoint(ctx, caller, path)
    blobs = blobs_of(ctx)
    mtime = int(utc(row.created_at).timestamp()) if row.created_at is not None else 0
    members: list[tuple[bytes, BinaryIO, int]] = []
    try:
        for name, ref in sorted(row.files.items()):
            # BlobStore keeps its layout private; a streamed file needs its path, as downloads do.
            # Opened now: an open file reads whole even after its blob is deleted.
            handle = open(blobs._path(row.tenant, ref["sha256"]), "rb")
            size = os.fstat(handle.fileno()).st_size
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = size, mtime, 0o644
            members.append((info.tobuf(format=tarfile.PAX_FORMAT), handle, size))
    except FileNotFoundError:
        _close(members)
        raise Gone(f"a file of {path!r} is no longer stored: the checkpoint was deleted or expired") from None
    filename = f"{row.run_id}-{row.kind}-{row.checkpoint_id.split('/', 1)[1]}.tar".replace("/", "_").replace(":", "_")
    length = sum(len(header) + size + _padding(size) for header, _, size in members) + 2 * tarfile.BLOCKSIZE

    def stream() -> Iterator[bytes]:
        try:
            for header, handle, size in members:
                yield header
                left = size
                while left > 0 and (chunk := handle.read(min(CHUNK, left))):
                    left -= len(chunk)
                    yield chunk
                if left:  # the file shrank under us: end short, so the client sees an error
                    raise RuntimeError(f"a file of {path!r} changed while it was read")
                yield b"\0" * _padding(size)
            yield b"\0" * (2 * tarfile.BLOCKSIZE)  # the end-of-archive marker
        finally:
            _close(members)

    headers = {"Content-Disposition": f'attachment; filename="{filename}"', "Content-Length": str(length)}
    return StreamingResponse(
        stream(), media_type="application/x-tar", headers=headers, background=BackgroundTask(_close, members)
    )


def _padding(size: int) -> int:
    return -size % tarfile.BLOCKSIZE


def _close(members) -> None:
    for _, handle, _ in members:
        handle.close()


@router.delete("/checkpoints")
def delete_checkpoint(path: str, ctx: GatewayContext = Depends(get_ctx), caller: Caller = Depends(get_caller)) -> dict:
    row = _visible_checkpoint(ctx, caller, path)
    freed = remove_checkpoint(ctx, row.tenant, row)
    return {"schema": "openrl.checkpoint_deleted.v1", "tinker_path": row.tinker_path, "freed_blobs": len(freed)}


@router.get("/sessions")
def list_sessions(
    limit: int = 100, offset: int = 0, ctx: GatewayContext = Depends(get_ctx), caller: Caller = Depends(get_caller)
) -> dict:
    check_limits(limit, offset)
    rows, total, runs, samplers = RunViews(ctx.store.engine).sessions(caller.tenant, limit, offset)
    sessions = [
        {
            "session_id": row.session_id,
            "tenant": row.tenant,
            "status": "finished" if row.finished_at is not None else "open",
            "project_id": row.project_id,
            "display_name": row.display_name,
            "training_runs": int(runs.get(row.session_id, 0)),
            "sampling_sessions": int(samplers.get(row.session_id, 0)),
            "created_at": iso(row.created_at),
            "last_heartbeat_at": iso(row.last_heartbeat_at),
            "finished_at": iso(row.finished_at),
            "finish_reason": row.finish_reason,
        }
        for row in rows
    ]
    return {"schema": "openrl.sessions.v1", "sessions": sessions, "total": total, "offset": offset}
