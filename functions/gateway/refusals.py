"""The audit trail of refused lookups: every 404 answered to an authenticated tenant.

Another tenant's object answers exactly like one that does not exist, so the caller learns
nothing; the operator must still be able to see who probed for what. The gateway's 404
handler therefore records one `access.lookup.refused` event (openrl_core.events.access says
why every 404 and not only cross-tenant ones) in the caller's stream: the store, then the
log, where the audit function writes it to the tenant's audit file. Recording never changes
the answer: a store or log failure is logged and the client still gets its 404. Feature
refusals (`NotOffered`) are not lookups and are not recorded.
"""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from functions.gateway import openai_wire
from functions.gateway.context import SOURCE, GatewayContext
from functions.gateway.deps import bearer_or_api_key
from openrl_core.errors import NotFound, NotOffered
from openrl_core.events import new_event
from openrl_core.events.access import LOOKUP_REFUSED, LookupRefused

log = logging.getLogger(__name__)
MAX_CHARS = 500  # a client chooses the path: the record stays small whatever it sends


def _short(text: str) -> str:
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 1] + "…"


def caller(request: Request) -> Optional[str]:
    """The tenant of the request's API key, if it has a valid one: sent the way the route
    takes it (the OpenAI-compatible routes take a Bearer key, whose probes count as much)."""
    ctx: Optional[GatewayContext] = getattr(request.app.state, "ctx", None)
    openai = request.url.path.startswith(openai_wire.PREFIX)
    api_key = bearer_or_api_key(request) if openai else request.headers.get("x-api-key")
    if ctx is None or not api_key:
        return None
    return ctx.tenant_for_key(api_key)


async def record(request: Request, exc: NotFound) -> None:
    if isinstance(exc, NotOffered):
        return
    tenant = caller(request)
    if tenant is None:
        return
    route = getattr(request.scope.get("route"), "path", None) or request.url.path
    payload = LookupRefused(
        method=request.method, route=route, path=_short(request.url.path), reason=_short(exc.detail)
    )
    event = new_event(LOOKUP_REFUSED, payload, tenant=tenant, source=SOURCE, subject=route)
    try:
        await run_in_threadpool(request.app.state.ctx.emit, event)
    except Exception:  # the 404 goes out regardless; the operator sees why the record is missing
        log.exception("could not record a refused lookup by tenant %s on %s %s", tenant, request.method, route)
