"""Futures: retrieve_future (one result), retrieve_futures (a sampling session's completions)
and cancel_future.

Both retrieves long-poll: an unfinished wait is held up to `long_poll_seconds` (under the
SDK's 45 s client timeout) and woken by the projector the moment a completion lands; only
then, or at the deadline, does the gateway answer. The SDK re-polls at once, so answering
early would turn into a busy loop. Results stay retrievable, again and again: the SDK asks
again after a lost response.

Rules the SDK relies on:
- complete_metadata: when the poll allows it and the rendered result is larger than
  `metadata_only_threshold_bytes`, the answer is only its size; the SDK reserves that much
  of its response budget and polls again with allow_metadata_only=false, which always gets
  the payload. The flag is the client's state, so the server keeps none: metadata is
  never sent to a poll that did not allow it (the SDK asserts as much), and a metadata
  answer that got lost is simply sent again.
- 410 (Gone) only for samples, and only when the sampling session is gone: the session that
  owns it was finished (`sessions/{id}/finish`) before the sample completed. The SDK's
  sampling retry handler then re-submits the sample. Training futures never answer 410.
- retrieve_futures reports each sample once per cursor (its first terminal event; see
  `eventing/store/feeds.py`), only to the clone whose seq_id range sent it, failed and
  cancelled alike as "failed". A held poll watches the session's unfinished samples, and
  asample wakes it to watch new ones; that wake-up is in-process, so with several gateway
  replicas a sample sent through another replica is only noticed when one of the watched
  ones completes or the window ends.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from eventing import topics
from eventing.store.event_store import Dedup
from eventing.store.feeds import SampleFeed
from eventing.store.projections import utc
from functions.gateway import proto
from functions.gateway.context import SOURCE, GatewayContext
from functions.gateway.deps import get_ctx, get_tenant, read_body
from openrl_core.errors import Gone, NotFound
from openrl_core.events import new_event
from openrl_core.events.sampling import SAMPLE_CANCEL_REQUESTED, SampleCancelRequested
from openrl_core.futures import FutureState, is_terminal
from openrl_core.wire.base import FutureRetrieveRequest, TryAgainResponse
from openrl_core.wire.futures import (
    CLONE_SEQ_STRIDE,
    CancelFutureRequest,
    CancelFutureResponse,
    FutureFailed,
    FutureFinished,
    FuturesRetrieveRequest,
    FuturesRetrieveResponse,
)

router = APIRouter(prefix="/api/v1")
PROTOBUF = "application/x-protobuf"
MAX_COMPLETIONS = 1000  # per retrieve_futures answer; the rest come on the next poll at once
# How long a retrieve_future trusts "still running" from memory before it reads the store.
PENDING_HINT_WAIT = 0.5


def submitted_key(sampling_session_id: str) -> str:
    """What asample notifies, so a held retrieve_futures also watches samples sent after it began."""
    return f"sampling-session-submitted:{sampling_session_id}"


# -- retrieve_future -----------------------------------------------------------------------


@router.post("/retrieve_future")
async def retrieve_future(
    request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> Response:
    body = FutureRetrieveRequest.model_validate_json(await read_body(request, 64 * 1024))
    accept = request.headers.get("accept", "")
    deadline = time.monotonic() + ctx.settings.long_poll_seconds
    with ctx.waiters.watch(body.request_id) as woken:
        first = True
        while True:
            # Clear before reading, never after: a completion that lands while the store is
            # being read must still end the wait below.
            woken.clear()
            finished = ctx.store.finished.get(tenant, body.request_id)
            if finished is not None and finished.kind != "sample":  # a sample's may be Gone: read its session
                return answer(finished, accept, body.allow_metadata_only, ctx.settings.metadata_only_threshold_bytes)
            # The first look only: a future this process knows is running needs no read to
            # say so (eventing/store/finished.py); its completion wakes the wait below, and
            # if that hint was wrong the store is read PENDING_HINT_WAIT later all the same
            # (as it is for a sample whose session finished meanwhile: Gone that much later).
            hinted, first = first and ctx.store.finished.pending(tenant, body.request_id), False
            if not hinted:
                done = await ctx.blocking(_answer_if_finished, ctx, tenant, body, accept)
                if done is not None:
                    return done
            remaining = deadline - time.monotonic()
            if remaining <= 0 and not hinted:  # a hint alone never answers: the store is read first
                # 408 with the try_again body: the SDK (0.22 and 0.38 alike) re-polls at once
                # either way, but a 200 try_again also logs a warning per poll, which floods
                # long training runs.
                queue_state = TryAgainResponse(request_id=body.request_id)
                return JSONResponse(queue_state.model_dump(exclude_none=True), status_code=408)
            try:
                await asyncio.wait_for(
                    woken.wait(), timeout=min(max(remaining, 0), PENDING_HINT_WAIT) if hinted else remaining
                )
            except asyncio.TimeoutError:
                pass


def _answer_if_finished(ctx: GatewayContext, tenant: str, body: FutureRetrieveRequest, accept: str):
    """The answer of a finished future, or None while it runs (one thread hop for both)."""
    row = _read_future(ctx, tenant, body.request_id)
    if not is_terminal(FutureState(row.state)):
        return None
    return answer(row, accept, body.allow_metadata_only, ctx.settings.metadata_only_threshold_bytes)


def _read_future(ctx: GatewayContext, tenant: str, request_id: str):
    row = ctx.projections.future(tenant, request_id)
    if row is None:
        raise NotFound(f"unknown request_id {request_id!r}")
    if row.kind == "sample" and row.session_id is not None:
        session = ctx.projections.session(tenant, row.session_id)
        finished_at = utc(session.finished_at) if session is not None else None
        completed_at = utc(row.completed_at)
        if finished_at is not None and (completed_at is None or completed_at > finished_at):
            raise Gone(f"sample {request_id!r} is gone: its session {row.session_id!r} finished before it completed")
    return row


def answer(row, accept: str, allow_metadata_only: bool, threshold: int) -> Response:
    response = render(row, accept)
    if allow_metadata_only and FutureState(row.state) is FutureState.COMPLETED and len(response.body) > threshold:
        return JSONResponse({"status": "complete_metadata", "response_payload_size": len(response.body)})
    return response


def render(row, accept: str) -> Response:
    state = FutureState(row.state)
    if state is FutureState.FAILED:
        return JSONResponse({"error": row.error or "failed", "category": row.category or "unknown"})
    if state is FutureState.CANCELLED:
        return JSONResponse({"error": row.error or "the request was cancelled", "category": "user"})
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


# -- retrieve_futures ----------------------------------------------------------------------


@router.post("/retrieve_futures")
async def retrieve_futures(
    request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> JSONResponse:
    body = FuturesRetrieveRequest.model_validate_json(await read_body(request, 4 * 1024 * 1024))
    sampling_session_id = body.target.sampling_session_id
    session = await ctx.blocking(ctx.projections.sampling_session, tenant, sampling_session_id)
    if session is None:
        raise NotFound(f"unknown sampling_session_id {sampling_session_id!r}")
    # `retrieved_request_ids` would let a server drop those payloads; results stay, so that a
    # lost retrieve_future answer can always be asked for again.
    feed = SampleFeed(ctx.store.engine, ctx.store.codec)
    hold = ctx.settings.long_poll_seconds if body.timeout is None else min(body.timeout, ctx.settings.long_poll_seconds)
    deadline = time.monotonic() + hold
    cursor = body.prev_cursor
    with ctx.waiters.watch(submitted_key(sampling_session_id)) as submitted:
        while True:
            submitted.clear()
            pending = await ctx.blocking(feed.pending, tenant, session.session_id, sampling_session_id)
            with ExitStack() as watches:
                # Registered before the feed is read, so a completion after the read wakes us.
                completed = [watches.enter_context(ctx.waiters.watch(request_id)) for request_id in pending]
                page = await ctx.blocking(feed.after, tenant, sampling_session_id, cursor, MAX_COMPLETIONS)
                cursor = page.cursor
                mine = [
                    c for c in page.completions if (c.seq_id or 0) // CLONE_SEQ_STRIDE == body.target.cloned_sampler_id
                ]
                remaining = deadline - time.monotonic()
                if mine or remaining <= 0:
                    completions = await ctx.blocking(_describe, feed, tenant, mine)
                    return JSONResponse(FuturesRetrieveResponse(completions=completions, cursor=cursor).model_dump())
                if not page.more:  # else read on at once: only other clones' completions so far
                    await _first_of([submitted, *completed], remaining)


def _describe(feed: SampleFeed, tenant: str, completions) -> list:
    results = feed.results(tenant, [c.request_id for c in completions if c.outcome == "finished"])
    described: list = []
    for completion in completions:
        if completion.outcome == "finished":
            # The size of what retrieve_future will send (the SDK polls samples for protobuf),
            # so the SDK reserves its response budget and fetches in one round trip.
            result = results.get(completion.request_id)
            size = len(proto.encode_sample_response(result)) if result is not None else None
            described.append(FutureFinished(request_id=completion.request_id, response_payload_uncompressed_size=size))
        else:
            described.append(FutureFailed(request_id=completion.request_id))
    return described


async def _first_of(events: list[asyncio.Event], timeout: float) -> None:
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


# -- cancel_future -------------------------------------------------------------------------


@router.post("/cancel_future")
async def cancel_future(
    request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(get_tenant)
) -> CancelFutureResponse:
    """Ask the sampler to drop a sample it has not started; anything else is left as it is.

    Training requests are never cancelled: each holds a seq_id that later requests of its
    model wait for. Cancelling twice is the same as once (one event, deduplicated).
    """
    body = CancelFutureRequest.model_validate_json(await read_body(request, 64 * 1024))
    row = await ctx.blocking(ctx.projections.future, tenant, body.request_id)
    if row is None:
        raise NotFound(f"unknown request_id {body.request_id!r}")
    status = _cancel_status(row)
    if status == "cancel_requested":
        session = await ctx.blocking(ctx.projections.sampling_session, tenant, row.model_id)
        payload = SampleCancelRequested(request_id=row.request_id, sampling_session_id=row.model_id)
        event = new_event(
            SAMPLE_CANCEL_REQUESTED, payload, tenant=tenant, source=SOURCE, key=row.model_id, subject=row.request_id
        )
        # Same topic and key as the sample itself, so the sampler sees the cancel after it.
        where = topics.topic(tenant, "sampling", ctx.models.canonical(session.base_model))
        await ctx.blocking(ctx.emit, event, where, Dedup.of(f"cancel:{row.request_id}", b""))
    return CancelFutureResponse(request_id=row.request_id, status=status)


def _cancel_status(row) -> str:
    if row.kind != "sample":
        return "not_cancellable"
    if is_terminal(FutureState(row.state)):
        return "already_finished"
    return "cancel_requested"
