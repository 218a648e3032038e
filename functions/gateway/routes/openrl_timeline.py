"""Who held each accelerator when: the timeslicer's timeline, for the dashboard, under
`/api/openrl/v1/timeline`.

The gateway asks the timeslicer daemon it can reach (`timeslicer_socket`, or the one
`openrl serve` runs on <data_dir>/timeslicer.sock) with the protocol's `timeline` op over
its Unix socket. When there is none (a gateway on its own, or workers on other nodes) the
answer is `available: false` with the reason, and the dashboard leaves the panel out.

Entries are the daemon's (kind `lease`, `park` or `restore`, unix-second `start` and `end`),
filtered for the caller. A job is named `<worker>/model/<run>` (a trainer's run),
`<worker>/run/<tenant>:<run>` (a sampler's full fine-tuned run) or `<worker>/base/<model>`
(base weights every tenant shares). The operator sees every entry with its job. A tenant sees
its own runs' entries with the run id, base-weight entries as `shared`, and every other
tenant's entry as `other`, with its times only: no run id, job, lease id or size of another
tenant's ever leaves the gateway, yet a tenant can still see why its step waited.
"""

from __future__ import annotations

import json
import socket
from typing import Any, Optional

from fastapi import APIRouter, Depends

from functions.gateway.context import GatewayContext
from functions.gateway.deps import Caller, get_caller, get_ctx
from functions.gateway.routes.openrl_runs import PREFIX, views
from functions.timeslicer.setup import socket_path
from openrl_core.errors import InvalidRequest

router = APIRouter(prefix=PREFIX)
ASK_SECONDS = 2.0
MAX_REPLY = 64 << 20


def ask_timeline(path: str, since: float) -> dict[str, list[dict]]:
    """One `timeline` request on a connection of its own (the daemon forgets a connection
    that holds no jobs as soon as it closes)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(ASK_SECONDS)
        conn.connect(path)
        conn.sendall((json.dumps({"op": "timeline", "id": 1, "since": since}) + "\n").encode())
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = conn.recv(1 << 16)
            if not chunk or len(reply) > MAX_REPLY:
                raise OSError("the timeslicer closed the connection before answering")
            reply += chunk
    answer = json.loads(reply)
    if not answer.get("ok"):
        raise OSError(f"the timeslicer refused: {answer.get('error')}")
    return answer["timeline"]


def owner_of(job: str) -> tuple[Optional[str], Optional[str], str]:
    """(run id, tenant if the name says it, role) of a job name; run id None for base weights."""
    _, _, rest = job.partition("/")
    kind, _, name = rest.partition("/")
    if kind == "model":
        return name, None, "trainer"
    if kind == "run":
        tenant, _, run_id = name.partition(":")
        return run_id, tenant, "sampler"
    return None, None, "shared"


def visible(entries: dict[str, list[dict]], caller: Caller, tenants: dict[str, str]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for device, items in entries.items():
        shown = []
        for entry in items:
            run_id, named_tenant, role = owner_of(str(entry.get("job", "")))
            tenant = named_tenant or (tenants.get(run_id) if run_id else None)
            base = {"kind": entry.get("kind"), "start": entry.get("start"), "end": entry.get("end")}
            if caller.operator:
                shown.append({**entry, "run_id": run_id, "tenant": tenant, "holder": role})
            elif run_id is None:
                shown.append({**base, "holder": "shared"})
            elif tenant == caller.tenant:
                extra = {k: entry[k] for k in ("reason", "bytes") if k in entry}
                shown.append({**base, **extra, "holder": role, "run_id": run_id})
            else:
                shown.append({**base, "holder": "other"})
        out[device] = shown
    return out


@router.get("/timeline")
def timeline(
    since: float = 0.0, ctx: GatewayContext = Depends(get_ctx), caller: Caller = Depends(get_caller)
) -> dict[str, Any]:
    if not since >= 0:  # also refuses NaN
        raise InvalidRequest(f"since must be unix seconds, 0 or more, got {since}")
    path = socket_path(ctx.settings)
    if not path.exists():
        return {"schema": "openrl.timeline.v1", "available": False, "reason": "no timeslicer on this gateway's node"}
    try:
        entries = ask_timeline(str(path), since)
    except (OSError, ValueError, KeyError) as error:
        return {"schema": "openrl.timeline.v1", "available": False, "reason": f"the timeslicer did not answer: {error}"}
    run_ids = {run for items in entries.values() for e in items for run in [owner_of(str(e.get("job", "")))[0]] if run}
    tenants = views(ctx).tenants_of_runs(sorted(run_ids)) if run_ids else {}
    return {"schema": "openrl.timeline.v1", "available": True, "devices": visible(entries, caller, tenants)}
