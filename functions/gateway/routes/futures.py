"""retrieve_future: the long-poll that hands every asynchronous result to the SDK.

An unfinished future is held up to `long_poll_seconds` (under the SDK's 45 s client
timeout) and woken by the projector the moment it completes; only then, or at the
deadline, does the gateway answer. The SDK re-polls try_again at once, so answering early
would turn into a busy loop. Results stay retrievable: the SDK may ask again after a lost
response.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from functions.gateway import proto
from functions.gateway.context import GatewayContext
from functions.gateway.deps import get_ctx, get_tenant, read_body
from openrl_core.errors import NotFound
from openrl_core.futures import FutureState, is_terminal
from openrl_core.wire.base import FutureRetrieveRequest, TryAgainResponse

router = APIRouter(prefix="/api/v1")
PROTOBUF = "application/x-protobuf"


@router.post("/retrieve_future")
async def retrieve_future(request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)) -> Response:
    body = FutureRetrieveRequest.model_validate_json(await read_body(request, 64 * 1024))
    deadline = time.monotonic() + ctx.settings.long_poll_seconds
    with ctx.waiters.watch(body.request_id) as woken:
        while True:
            # Clear before reading, never after: a completion that lands while the store is
            # being read must still end the wait below.
            woken.clear()
            row = await run_in_threadpool(ctx.projections.future, tenant, body.request_id)
            if row is None:
                raise NotFound(f"unknown request_id {body.request_id!r}")
            state = FutureState(row.state)
            if is_terminal(state):
                return render(row, request.headers.get("accept", ""))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                # 408 with the try_again body: the SDK re-polls at once either way, but a 200
                # try_again also logs a warning per poll, which floods long training runs.
                queue_state = TryAgainResponse(request_id=body.request_id)
                return JSONResponse(queue_state.model_dump(exclude_none=True), status_code=408)
            try:
                await asyncio.wait_for(woken.wait(), timeout=remaining)
            except asyncio.TimeoutError:
                pass


def render(row, accept: str) -> Response:
    state = FutureState(row.state)
    if state is FutureState.FAILED:
        return JSONResponse({"error": row.error or "failed", "category": row.category or "unknown"})
    if state is FutureState.CANCELLED:
        return JSONResponse({"error": "the request was cancelled", "category": "user"})
    result = row.result
    if row.kind == "forward_backward":
        if PROTOBUF in accept:
            return Response(proto.encode_forward_backward_output(result), media_type=PROTOBUF)
        return JSONResponse(proto.forward_backward_output_json(result))
    if row.kind == "sample":
        if PROTOBUF in accept:
            return Response(proto.encode_sample_response(result), media_type=PROTOBUF)
        return JSONResponse(proto.sample_response_json(result))
    return JSONResponse(result)
