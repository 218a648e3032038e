"""Submitting an asynchronous request: validate, dedup, store, publish, answer a future.

Sequenced (training) requests share one rule: a model's seq_id is used once. A retry with
the same body gets the first future back; another body with that seq_id is a 409. A
request the gateway refuses still consumes its seq_id (a `seq.skipped` event tells the
trainer), because the SDK keeps sending later seq_ids and the model must not stall
waiting for one that will never come. The one exception is a quota refusal (429): the SDK
retries it with the same seq_id, so it stores nothing and consumes nothing (see
`functions/gateway/quotas.py`).

`submitting(ctx, fn, tenant, body, *more)` runs a route's blocking part in a gateway thread the way
`ctx.blocking` does, except that a `submit` inside it does not wait there for the append:
the thread queues the event with the appender's writer (`GroupCommit.submit_later`) and is
free at once, and the route awaits the write on the event loop. So submissions waiting on a
slow log (a broker restarting) do not fill the gateway's threads and stall its reads. The
client still sees its future only once the event is stored and on the log. A tenant with
quotas is the exception: its check and append must run under the tenant's lock, which a
thread holds, so it waits in the thread as before. A refused training request's
`seq.skipped` event is deferred the same way, and its refusal raised once that is stored.

On a SQLite store a small request (`gateway_inline_body_bytes`) of a tenant without quotas
runs `fn` on the event loop itself: then nothing in it waits (its reads are local SQLite
reads of a few tens of microseconds, its append is deferred), and the hop to a thread and
back cost more than the work. Measured with the futures bench (16 clients, no-op worker,
three pairs alternating with the thread hop): 748-763 against 620-668 futures/s, context
switches per future 13 against 33-34, server CPU 1.3-1.4 against 1.6-1.7 ms per future.
On PostgreSQL a read is a network round trip (and a connect can hang while the database is
away), and a large body takes long to parse, so those stay in a thread, and so do quota
tenants' submissions, which wait for their append.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, Generic, Optional, TypeVar, Union

from eventing import topics
from eventing.store.event_store import Appended, Dedup
from functions.gateway import quotas
from functions.gateway.context import SOURCE, GatewayContext
from openrl_core.errors import UserError
from openrl_core.events import new_event
from openrl_core.events.base import Payload
from openrl_core.events.training import SEQ_SKIPPED, SeqSkipped
from openrl_core.ids import new_request_id
from openrl_core.wire.base import UntypedAPIFuture

T = TypeVar("T")


class Later(Generic[T]):
    """What `submit` answers inside `submitting`: the appender's future, then how to make
    the route's answer from its outcome (on the loop, so nothing blocking)."""

    def __init__(self, written: "asyncio.Future", finish: Callable[[object], T]) -> None:
        self.written = written
        self.finish = finish

    async def result(self) -> T:
        return self.finish(await self.written)


_deferring = threading.local()  # .loop: set while a `submitting` call runs (in a gateway thread or on the loop)


async def submitting(ctx: GatewayContext, fn: Callable[..., Union[T, Later[T]]], tenant: str, body: bytes, *more) -> T:
    """`await ctx.blocking(fn, ctx, tenant, body, *more)`, where the append of a `submit` in
    `fn` is awaited on the loop instead of in the thread; `fn` runs on the loop when
    `runs_inline` (module docstring)."""
    loop = asyncio.get_running_loop()
    args = (ctx, tenant, body, *more)
    if runs_inline(ctx, tenant, body):
        done = _run_deferring(loop, fn, args)
    else:
        done = await ctx.blocking(_run_deferring, loop, fn, args)
    return await done.result() if isinstance(done, Later) else done


def runs_inline(ctx: GatewayContext, tenant: str, body: bytes) -> bool:
    """Whether a submission's blocking part may run on the event loop (module docstring)."""
    return (
        len(body) <= ctx.settings.gateway_inline_body_bytes
        and ctx.store.engine.dialect.name == "sqlite"
        and not ctx.settings.quotas(tenant)[0].any
    )


def _run_deferring(loop: asyncio.AbstractEventLoop, fn: Callable, args: tuple):
    _deferring.loop, _deferring.made = loop, None
    try:
        done = fn(*args)
        # A Later is the route's answer or nothing: whatever `fn` did after a deferred submit
        # would have run before its event was stored, and a second submit's would be lost.
        if _deferring.made is not None and done is not _deferring.made:
            raise RuntimeError(f"{getattr(fn, '__name__', fn)}: a deferred submit's Later must be what it returns")
        return done
    finally:
        _deferring.loop = _deferring.made = None


def seq_dedup(model_id: str, seq_id: int, body: bytes) -> Dedup:
    return Dedup.of(f"seq:{model_id}:{seq_id}", body)


def training_stream(full_finetune: bool) -> str:
    """Full fine-tuning runs have topics of their own, so a trainer (or one per run) can
    serve them apart from the shared-base LoRA trainer of the same base model."""
    return "training-full" if full_finetune else "training"


def submit_sequenced(
    ctx: GatewayContext,
    tenant: str,
    *,
    run,
    seq_id: int,
    body: bytes,
    event_type: str,
    build: Callable[[str], Payload],
) -> Union[UntypedAPIFuture, Later[UntypedAPIFuture]]:
    """`build(request_id)` makes the payload; a UserError from it refuses the seq_id.
    `run` is the model's training_runs row (its id, base model and kind route the event)."""
    model_id, base_model, stream = run.model_id, run.base_model, training_stream(not run.is_lora)
    dedup = seq_dedup(model_id, seq_id, body)
    request_id = new_request_id()
    try:
        payload = build(request_id)
        quotas.check_fits_at_all(ctx, tenant, quotas.cost_of(payload))
    except UserError as refused:
        return refuse(ctx, tenant, model_id, base_model, seq_id, dedup, refused, stream)
    return submit(
        ctx,
        tenant,
        event_type,
        payload,
        stream=stream,
        base_model=base_model,
        key=model_id,
        dedup=dedup,
        model_id=model_id,
    )


def submit(
    ctx: GatewayContext,
    tenant: str,
    event_type: str,
    payload: Payload,
    *,
    stream: str,
    base_model: str,
    key: str,
    dedup: Optional[Dedup],
    model_id: Optional[str] = None,
    sample_sequence_ids: Optional[list[str]] = None,
    admit: bool = True,
) -> Union[UntypedAPIFuture, Later[UntypedAPIFuture]]:
    """The request's future; inside `submitting` (and without quotas to hold a lock for) a
    `Later` of it. `admit=False`: the caller already admitted this submission against the
    tenant's quotas (a multi-prompt OpenAI request is admitted whole, then submitted prompt
    by prompt)."""
    request_id = payload.request_id  # type: ignore[attr-defined]
    event = new_event(event_type, payload, tenant=tenant, source=SOURCE, key=key, subject=request_id)
    # Work is routed by the weights it runs on: an alias goes where its target's workers are.
    topic = topics.topic(tenant, stream, ctx.models.canonical(base_model))
    cost = quotas.cost_of(payload) if admit else None

    def future(appended: Appended) -> UntypedAPIFuture:
        first, sequence_ids = request_id, sample_sequence_ids
        if appended.duplicate_of is not None:
            first = appended.duplicate_of
            if sequence_ids is not None:
                sequence_ids = [f"{first}:{i}" for i in range(len(sequence_ids))]
        return UntypedAPIFuture(request_id=first, model_id=model_id, sample_sequence_ids=sequence_ids)

    if not quotas.limited(ctx, tenant, cost) and (later := _deferred(ctx, event, topic, dedup, future)) is not None:
        return later
    with quotas.admitted(ctx, tenant, cost, dedup):
        appended = ctx.emit(event, topic, dedup)
    return future(appended)


def refuse(
    ctx: GatewayContext,
    tenant: str,
    model_id: str,
    base_model: str,
    seq_id: int,
    dedup: Dedup,
    refused: UserError,
    stream: str = "training",
) -> "Later":
    """Record the refusal under the submission's identity and tell the trainer to skip it;
    then raise `refused` (inside `submitting`: a Later that raises it once the skip is stored)."""
    skipped = SeqSkipped(model_id=model_id, seq_id=seq_id, reason=refused.detail)
    event = new_event(SEQ_SKIPPED, skipped, tenant=tenant, source=SOURCE, key=model_id)
    topic = topics.topic(tenant, stream, ctx.models.canonical(base_model))

    def answer(_appended: object):
        raise refused

    later = _deferred(ctx, event, topic, dedup.refused(), answer)
    if later is not None:
        return later
    ctx.emit(event, topic, dedup.refused())
    raise refused


def _deferred(
    ctx: GatewayContext, event, topic: str, dedup: Optional[Dedup], finish: Callable[[object], T]
) -> Optional[Later[T]]:
    """Inside `submitting`: queue the append with the appender's writer and return the Later
    the route answers with (one per call); elsewhere None, and the caller appends itself."""
    loop = getattr(_deferring, "loop", None)
    if loop is None:
        return None
    if getattr(_deferring, "made", None) is not None:
        raise RuntimeError("one deferred submit per `submitting` call: its Later is the route's answer")
    _deferring.made = Later(ctx.appender.append_later(event, topic, dedup, loop), finish)  # type: ignore[arg-type]
    return _deferring.made
