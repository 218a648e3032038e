"""Every error leaves the gateway as `{"detail": "<what was wrong>"}` with a fitting status.

Never an empty 400: the SDK takes an empty-bodied 400 for a proxy glitch and retries it.
Validation errors become a 400 whose detail names each bad field in one sentence.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from functions.gateway import refusals
from openrl_core.errors import NotFound, OpenRLError

log = logging.getLogger(__name__)


def describe_validation(errors) -> str:
    parts = []
    for error in errors:
        location = ".".join(str(part) for part in error.get("loc", ()) if part not in ("body",))
        parts.append(f"{location or 'body'}: {error.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def install(app: FastAPI) -> None:
    @app.exception_handler(OpenRLError)
    async def _openrl(_request: Request, exc: OpenRLError) -> JSONResponse:
        if exc.http_status >= 500:
            log.error("server error: %s", exc.detail)
        return JSONResponse({"detail": exc.detail}, status_code=exc.http_status)

    @app.exception_handler(NotFound)
    async def _not_found(request: Request, exc: NotFound) -> JSONResponse:
        await refusals.record(request, exc)  # the audit trail of lookups a tenant was refused
        return JSONResponse({"detail": exc.detail}, status_code=exc.http_status)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": describe_validation(exc.errors())}, status_code=400)

    @app.exception_handler(ValidationError)
    async def _validation(_request: Request, exc: ValidationError) -> JSONResponse:
        return JSONResponse({"detail": describe_validation(exc.errors())}, status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"detail": str(exc.detail or "error")}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}"}, status_code=500)
