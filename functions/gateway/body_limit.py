"""The request body limit: no route reads more than `max_request_bytes` of a body.

Enforced once, in front of every route, because FastAPI parses some bodies itself before
any route code could count them. A declared Content-Length over the limit is answered 413
at once, without reading the body; a body without one (chunked) is counted as it streams
and refused with a 413 the moment it passes the limit, so a client cannot make the server
buffer more than the limit either way. The answer names the limit and the setting that
raises it, like every other refusal (`{"detail": ...}`, or OpenAI's error object under `/v1/`).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from functions.gateway.openai_wire import PREFIX, error_body

SETTING = "max_request_bytes (OPENRL_MAX_REQUEST_BYTES)"


def too_large(size: str, limit: int) -> str:
    return f"request body of {size} bytes is over this server's {limit}-byte limit (setting {SETTING})"


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            detail = too_large(declared.decode(), self.limit)
            body = error_body(413, detail) if scope.get("path", "").startswith(PREFIX) else {"detail": detail}
            response = JSONResponse(body, status_code=413)
            await response(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # Raised inside the route's body read: the app's HTTPException handler
                    # answers it (FastAPI passes an HTTPException from a body read through).
                    raise HTTPException(413, detail=too_large(f"more than {self.limit}", self.limit))
            return message

        await self.app(scope, counted, send)
