"""Request dependencies: the process context, the caller's tenant, owned-object lookups.

Lookups are tenant-scoped: another tenant's session, model or future is "unknown", with
the same 404 an id that never existed gets.
"""

from __future__ import annotations

from fastapi import Request

from functions.gateway.context import GatewayContext
from openrl_core.errors import InvalidRequest, NotFound, PayloadTooLarge, Unauthorized


def get_ctx(request: Request) -> GatewayContext:
    return request.app.state.ctx


def get_tenant(request: Request) -> str:
    api_key = request.headers.get("x-api-key")
    if not api_key:
        raise Unauthorized("missing X-API-Key header")
    return tenant_of_key(request.app.state.ctx, api_key)


def tenant_of_key(ctx: GatewayContext, api_key: str) -> str:
    tenant = ctx.tenant_for_key(api_key)
    if tenant is None:
        raise Unauthorized("unknown API key")
    return tenant


def require_session(ctx: GatewayContext, tenant: str, session_id: str):
    row = ctx.projections.session(tenant, session_id)
    if row is None:
        raise NotFound(f"unknown session_id {session_id!r}")
    return row


def require_run(ctx: GatewayContext, tenant: str, model_id: str):
    row = ctx.projections.run(tenant, model_id)
    if row is None:
        raise NotFound(f"unknown model_id {model_id!r}")
    if row.state == "failed":
        raise InvalidRequest(f"model {model_id!r} failed to load: {row.error}")
    return row


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 over `limit` (some routes take less than the server-wide
    `max_request_bytes`, which `BodyLimit` enforces in front of every route)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes is over this route's {limit}-byte limit")
    body = await request.body()
    if len(body) > limit:
        raise PayloadTooLarge(f"request body of {len(body)} bytes is over this route's {limit}-byte limit")
    return body
