"""Every error leaves the gateway as `{"detail": "<what was wrong>"}` with a fitting status.

Never an empty 400: the SDK takes an empty-bodied 400 for a proxy glitch and retries it.
Validation errors become a 400 whose detail names each bad field in one sentence. A quota
refusal is a 429 with a `Retry-After` header. Under
`/v1/` (the OpenAI-compatible routes) the same message goes out in OpenAI's error shape
instead, because OpenAI clients read `error.message` and nothing else.

The event store unreachable (PostgreSQL down or restarting, its pool exhausted) is a 503 with
`Retry-After`, not a 500: the same request sent again later is safe
(a sequenced request's retry is deduplicated by its seq_id), and the SDK retries it by itself.
"""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy import exc as sql_errors
from starlette.exceptions import HTTPException

from functions.gateway import openai_wire, refusals
from functions.gateway.openai_wire import error_body
from functions.gateway.route_tree import leaf_routes
from openrl_core.errors import NotFound, OpenRLError
from openrl_core.quotas import QuotaExceeded

log = logging.getLogger(__name__)


def describe_validation(errors) -> str:
    parts = []
    for error in errors:
        location = ".".join(str(part) for part in error.get("loc", ()) if part not in ("body",))
        parts.append(f"{location or 'body'}: {error.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


OPENAI_PREFIX = openai_wire.PREFIX
# The SDK sleeps what Retry-After says (up to 60 s) before each of its 10 retries: 5 s rides
# out about 50 s of database outage without the researcher's loop seeing an error.
STORE_RETRY_AFTER_SECONDS = 5
# Errors that mean "the database could not be reached", not "the statement was wrong".
STORE_UNAVAILABLE = (sql_errors.OperationalError, sql_errors.InterfaceError, sql_errors.TimeoutError)


def respond(
    request: Request,
    status: int,
    detail: str,
    openai_code: Optional[str] = None,
    headers: Optional[dict[str, str]] = None,
) -> JSONResponse:
    body = error_body(status, detail, openai_code) if request.url.path.startswith(OPENAI_PREFIX) else {"detail": detail}
    return JSONResponse(body, status_code=status, headers=headers)


def allowed_methods(request: Request) -> list[str]:
    """Every method some route takes at this path. Starlette's own 405 names only the first
    route that matched the path, and several routes (in different routers) share paths.
    As in OpenAPI, a literal path (`/sessions/search`) is its own resource: routes with
    parameters that would also match it (`/sessions/{session_id}`) do not count there."""
    literal: set[str] = set()
    templated: set[str] = set()
    path = request.scope.get("path", "")

    for prefix, route in leaf_routes(request.app.router.routes):
        if path.startswith(prefix) and getattr(route, "path_regex", None) is not None:
            if route.path_regex.match(path[len(prefix) :]):
                found = templated if "{" in route.path else literal
                found.update(getattr(route, "methods", None) or ())
    return sorted(literal or templated)


def store_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, STORE_UNAVAILABLE):
        return True
    # a connection that died under a statement surfaces as a DBAPIError flagged so
    return isinstance(exc, sql_errors.DBAPIError) and bool(exc.connection_invalidated)


def install(app: FastAPI) -> None:
    @app.exception_handler(OpenRLError)
    async def _openrl(request: Request, exc: OpenRLError) -> JSONResponse:
        if exc.http_status >= 500:
            log.error("server error: %s", exc.detail)
        if isinstance(exc, QuotaExceeded):
            # Retry-After tells the SDK when to resend (it honours up to 60 s); OpenAI clients
            # read the same header and this code.
            response = respond(request, exc.http_status, exc.detail, "rate_limit_exceeded")
            response.headers["Retry-After"] = str(exc.retry_after)
            return response
        return respond(request, exc.http_status, exc.detail, getattr(exc, "openai_code", None))

    @app.exception_handler(NotFound)
    async def _not_found(request: Request, exc: NotFound) -> JSONResponse:
        await refusals.record(request, exc)  # the audit trail of lookups a tenant was refused
        return respond(request, exc.http_status, exc.detail, getattr(exc, "openai_code", None))

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, 400, describe_validation(exc.errors()))

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError) -> JSONResponse:
        return respond(request, 400, describe_validation(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(allowed_methods(request))
        return respond(request, exc.status_code, str(exc.detail or "error"), headers=headers or None)

    @app.exception_handler(sql_errors.SQLAlchemyError)
    async def _store(request: Request, exc: sql_errors.SQLAlchemyError) -> JSONResponse:
        if not store_unavailable(exc):
            return await _unexpected(request, exc)
        log.warning("event store unavailable: %s", type(exc).__name__)  # its text may hold the URL
        detail = f"the event store is unreachable; retry in {STORE_RETRY_AFTER_SECONDS} s"
        return respond(request, 503, detail, "service_unavailable", {"Retry-After": str(STORE_RETRY_AFTER_SECONDS)})

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return respond(request, 500, f"internal error: {type(exc).__name__}")
