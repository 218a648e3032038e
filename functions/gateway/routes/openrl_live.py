"""A run as it happens, for the dashboard: its event stream (server-sent events) and its
sampling throughput, under `/api/openrl/v1`. Same rules as `openrl_runs`: a tenant sees its
own runs, the operator every tenant's, another tenant's run is a 404 like an unknown one.

`GET /runs/{id}/events` is `text/event-stream`. Each message is one stored event of the run
(keyed by the run or by one of its sampling sessions), `id:` its store position and `data:`
one JSON object (schema `openrl.event.v1`): `position`, `id`, `type`, `name`
(family.verb.phase), `key`, `subject`, `time` and `fields`, the payload's small fields, with
lists as their length and large payloads (claim-checked) as their size only: token arrays
and weights never travel. History first (the last `history` events, or those after `after`
or the `Last-Event-ID` header, which browsers send when they reconnect), then new events as
the store gets them. Completions wake the stream at once (the long-polls' wake-up); events
the gateway itself stores (requests, cancellation) are picked up by a poll every
`POLL_SECONDS`, which also covers events another replica stored. Every read runs in the
thread pool, never on the event loop. A stream ends after `event_stream_seconds` (a setting,
25 s by default; the client reconnects where it left off), so one never holds a server that is shutting down longer
than a long-poll does; a comment line keeps idle proxies from closing it before that.

`GET /runs/{id}/sampling` is the run's sampling throughput. `steps`: per completed optim_step
N, the sample requests of its sampling sessions that completed between step N-1 and step N,
their generated tokens, their busy seconds (the union of their spans, so concurrent requests
count once) and tokens per second (`openrl_core.sampling_rate`), over the latest
`MAX_STEP_SAMPLES` requests: a step whose window may hold older ones is left out rather than
undercounted. `samples`: per completed sample request (the latest `MAX_SAMPLES`), the tokens
it generated and the seconds from the gateway taking it to its completion, as the client saw
them (queueing included).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from eventing.store.projections import utc
from functions.gateway.context import GatewayContext
from functions.gateway.deps import Caller, get_caller, get_ctx
from functions.gateway.routes.openrl_runs import PREFIX, iso, require_visible_run, seconds, views
from openrl_core import sampling_rate
from openrl_core.errors import InvalidRequest
from openrl_core.wire.futures import MAX_POSITION

router = APIRouter(prefix=PREFIX)
POLL_SECONDS = 1.0
KEEPALIVE_SECONDS = 10.0
BATCH = 200
MAX_HISTORY = 1000
MAX_SAMPLES = 500
# Results are read whole (token arrays included) to count what each generated: bounded.
MAX_STEP_SAMPLES = 2000
TEXT_LIMIT = 80


def _small(value: Any) -> Any:
    """A payload field as the stream shows it: scalars as they are (long text cut), lists as
    their length, objects by their keys, except a result's metrics, which are what one watches."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return value if len(value) <= TEXT_LIMIT else value[: TEXT_LIMIT - 1] + "…"
    if isinstance(value, (list, tuple)):
        return f"[{len(value)}]"
    if isinstance(value, dict):
        metrics = value.get("metrics")
        if isinstance(metrics, dict) and all(isinstance(v, (int, float)) for v in metrics.values()):
            return {"metrics": dict(list(metrics.items())[:12])}
        names = list(value)
        return "{" + ", ".join(names[:6]) + (", …" if len(names) > 6 else "") + "}"
    return _small(str(value))


def event_json(ctx: GatewayContext, tenant: str, row) -> dict[str, Any]:
    parts = row.type.split(".")
    fields: dict[str, Any] = {}
    if row.claim_size is not None:
        fields["payload_bytes"] = int(row.claim_size)  # claim-checked: too large to be worth loading
    else:
        try:
            payload = ctx.store.codec.unpack(tenant, row.type, row.data, None)
            fields = {
                name: _small(value) for name, value in payload.model_dump(mode="json").items() if value is not None
            }
        except Exception as error:  # an event type this gateway does not know (a newer worker's)
            fields = {"undecoded": type(error).__name__}
    return {
        "schema": "openrl.event.v1",
        "position": int(row.position),
        "id": row.id,
        "type": row.type,
        "name": ".".join(parts[2:5]),
        "key": row.key,
        "subject": row.subject,
        "time": iso(row.time),
        "fields": fields,
    }


def _start_position(after: Optional[int], last_event_id: Optional[str]) -> Optional[int]:
    if last_event_id is not None:
        if not (last_event_id.isascii() and last_event_id.isdigit() and int(last_event_id) <= MAX_POSITION):
            raise InvalidRequest(
                f"Last-Event-ID must be an event position (a whole number), got {last_event_id[:40]!r}"
            )
        return int(last_event_id)
    if after is not None and not 0 <= after <= MAX_POSITION:  # store positions are 64-bit integers
        raise InvalidRequest(f"after must be between 0 and {MAX_POSITION}, got {after}")
    return after


@router.get("/runs/{run_id}/events")
async def run_events(
    run_id: str,
    request: Request,
    after: Optional[int] = None,
    history: int = 50,
    ctx: GatewayContext = Depends(get_ctx),
    caller: Caller = Depends(get_caller),
) -> StreamingResponse:
    row = await run_in_threadpool(require_visible_run, ctx, caller, run_id)
    start = _start_position(after, request.headers.get("last-event-id"))
    if not 0 <= history <= MAX_HISTORY:
        raise InvalidRequest(f"history must be between 0 and {MAX_HISTORY}, got {history}")
    tenant, store = row.tenant, views(ctx)

    def keys() -> list[str]:
        # Re-read each time: sampling sessions on the run's weights appear while it trains.
        return [run_id, *(s.sampling_session_id for s in store.sampling_sessions_of_run(tenant, run_id))]

    def first() -> tuple[int, list[dict]]:
        """Where to follow from, and the history to send before that."""
        if start is not None:
            return start, [event_json(ctx, tenant, r) for r in store.run_events(tenant, keys(), start, BATCH)]
        rows = store.run_events(tenant, keys(), 0, max(history, 1), newest=True)
        if not history:
            return (int(rows[-1].position) if rows else 0), []
        return 0, [event_json(ctx, tenant, r) for r in rows]

    def more(position: int) -> list[dict]:
        return [event_json(ctx, tenant, r) for r in store.run_events(tenant, keys(), position, BATCH)]

    async def stream() -> AsyncIterator[str]:
        deadline = time.monotonic() + ctx.settings.event_stream_seconds
        quiet_since = time.monotonic()
        with ctx.waiters.watch_all() as woken:
            # Cleared before each read, so a completion stored while the read runs still
            # wakes the wait after it.
            position, batch = await run_in_threadpool(first)
            # Only now the first byte: a client that acts once the stream has started (as
            # soon as it sees this line) must find its events after the starting position.
            yield f"retry: {int(POLL_SECONDS * 1000)}\n\n"
            while True:
                for event in batch:
                    position = event["position"]
                    yield f"id: {position}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
                    quiet_since = time.monotonic()
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                if len(batch) < BATCH:  # caught up: sleep until a wake-up or the next poll
                    try:
                        await asyncio.wait_for(woken.wait(), min(POLL_SECONDS, left))
                    except asyncio.TimeoutError:
                        pass
                    if time.monotonic() - quiet_since >= KEEPALIVE_SECONDS:
                        yield ": keep-alive\n\n"
                        quiet_since = time.monotonic()
                woken.clear()
                batch = await run_in_threadpool(more, position)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)


def _generated(row) -> tuple[int, int]:
    """(sequences, generated tokens) of a finished sample request's stored result."""
    sequences = (row.result or {}).get("sequences") or []
    return len(sequences), sum(len(s.get("tokens") or ()) for s in sequences if isinstance(s, dict))


def sample_json(row) -> dict[str, Any]:
    sequences, tokens = _generated(row)
    took = seconds(row.created_at, row.completed_at)
    return {
        "request_id": row.request_id,
        "sampling_session_id": row.model_id,
        "completed_at": iso(row.completed_at),
        "sequences": sequences,
        "tokens": tokens,
        "seconds": took,
        "tokens_per_second": round(tokens / took, 3) if took else None,
    }


def step_sampling(steps, rows, complete: bool) -> list[dict[str, Any]]:
    """Per-step throughput over these sample rows; `complete` False: older rows were left out."""
    ends = [(int(s.step), utc(s.completed_at).timestamp()) for s in steps]
    spans = [
        sampling_rate.SampleSpan(utc(r.created_at).timestamp(), utc(r.completed_at).timestamp(), _generated(r)[1])
        for r in rows
        if r.completed_at is not None
    ]
    oldest = min((span.completed for span in spans), default=None)
    out = []
    previous_ends = [None, *[end for _, end in ends]]
    for previous, entry in zip(previous_ends, sampling_rate.per_step(ends, spans)):
        # The left-out rows completed at or before the oldest loaded one: a window reaching
        # back that far may be missing some of them.
        if not complete and (previous is None or previous < oldest):
            continue
        out.append(
            {
                "step": entry.step,
                "requests": entry.requests,
                "tokens": entry.tokens,
                "seconds": entry.seconds,
                "tokens_per_second": entry.tokens_per_second,
            }
        )
    return out


@router.get("/runs/{run_id}/sampling")
def run_sampling(run_id: str, ctx: GatewayContext = Depends(get_ctx), caller: Caller = Depends(get_caller)) -> dict:
    row = require_visible_run(ctx, caller, run_id)
    store = views(ctx)
    samplers = [s.sampling_session_id for s in store.sampling_sessions_of_run(row.tenant, run_id)]
    rows = store.finished_samples(row.tenant, samplers, MAX_STEP_SAMPLES) if samplers else []
    steps = step_sampling(store.steps(run_id), rows, complete=len(rows) < MAX_STEP_SAMPLES)
    samples = [sample_json(r) for r in rows[-MAX_SAMPLES:]]
    return {
        "schema": "openrl.sampling.v1",
        "run_id": run_id,
        "sampling_sessions": samplers,
        "steps": steps,
        "samples": samples,
    }
