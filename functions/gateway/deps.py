"""Request dependencies: the process context, the caller's tenant, owned-object lookups.

The dependencies are `async def` because they do no I/O: FastAPI runs a plain `def`
dependency in a worker thread, and that hop (two per request) cost more CPU than the rest of
a small request's route.

Lookups are tenant-scoped: another tenant's session, model or future is "unknown", with
the same 404 an id that never existed gets. A cancelled run, and a sampling session its
cancellation closed, answer 410 to every later request.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Optional

from fastapi import Request

from functions.gateway.context import GatewayContext
from openrl_core.errors import Gone, InvalidRequest, NotFound, PayloadTooLarge, Unauthorized


async def get_ctx(request: Request) -> GatewayContext:
    return request.app.state.ctx


async def get_tenant(request: Request) -> str:
    return tenant_of_request(request)


def tenant_of_request(request: Request) -> str:
    api_key = request.headers.get("x-api-key")
    if not api_key:
        raise Unauthorized("missing X-API-Key header")
    return tenant_of_key(request.app.state.ctx, api_key)


def bearer_or_api_key(request: Request) -> Optional[str]:
    """The key of an OpenAI-style request: `Authorization: Bearer KEY` (what OpenAI clients
    send), else the Tinker `X-API-Key`."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return (token.strip() if scheme.lower() == "bearer" else None) or request.headers.get("x-api-key")


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
    known = ctx.store.runs  # kept rows, where this process sees every change (eventing/store/known_runs.py)
    row = known.get(tenant, model_id)
    if row is None:
        generation = known.generation()
        row = ctx.projections.run(tenant, model_id)
        known.put(model_id, row, generation)
    if row is None:
        raise NotFound(f"unknown model_id {model_id!r}")
    if row.state == "failed":
        raise InvalidRequest(f"model {model_id!r} failed to load: {row.error}")
    if row.state == "cancelled":
        # 410, not 409: the SDK retries a 409 for minutes; a cancelled run never comes back.
        raise Gone(
            f"training run {model_id!r} was cancelled; it takes no more requests (its saved checkpoints remain: "
            "start a new run from one with create_training_client_from_state)"
        )
    return row


def require_open_sampler(row, sampling_session_id: str):
    if row.closed_at is not None:
        raise Gone(f"sampling session {sampling_session_id!r} is closed: its training run {row.run_id!r} was cancelled")
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


@dataclass(frozen=True)
class Caller:
    """Who calls the OpenRL API: a tenant, or the operator (tenant None), who sees every tenant."""

    tenant: Optional[str]

    @property
    def operator(self) -> bool:
        return self.tenant is None


async def get_caller(request: Request) -> Caller:
    ctx: GatewayContext = request.app.state.ctx
    api_key = request.headers.get("x-api-key")
    if (
        api_key
        and ctx.operator_key_hash is not None
        and hmac.compare_digest(GatewayContext.hash_key(api_key), ctx.operator_key_hash)
    ):
        return Caller(tenant=None)
    return Caller(tenant=tenant_of_request(request))
