"""The OpenAI-compatible endpoint: `POST /v1/completions`, `POST /v1/chat/completions`,
`GET /v1/models` (and `GET /v1/models/{model}`), for the official `openai` client and
anything else that speaks OpenAI's API.

Contract: an OpenAI request is turned into ordinary `sample.requested` events (one per
prompt, `n` samples each) on the tenant's sampling topic, submitted exactly as `asample`
submits them, and answered from their futures, awaited as `retrieve_future` awaits them
(woken by the projector, never a polling loop). The gateway loads no model, only the
model's tokenizer (`openai_text`): the sampler workers do the sampling, with every rule the
Tinker routes have (batching, adapters, timeslicing, the event log, replay).

- Streaming: the sampler has no token-by-token streaming, so `stream: true` waits for the
  finished sample and then sends it as OpenAI chunks, one per token, as server-sent events
  ending with `data: [DONE]`. The pieces join to exactly the non-streamed text.
- `model`: a catalogue name or alias, or a `tinker://…` checkpoint path of the caller's
  tenant (a `sampler_weights/` path, or a LoRA run's `weights/`), resolved on every request,
  so a deleted, expired or overwritten checkpoint is seen at once. An unknown name, a
  malformed path and another tenant's path all get the same 404 `model_not_found`.
- Sessions: a Tinker sample belongs to a sampling session of a session, and the scheduler,
  the dashboard and replay see sampling through them. Each tenant gets one session for this
  endpoint (its id derived from the tenant, tagged "openai") and one sampling session per
  `model` string, both made on first use with deduplicated events, so retries and races
  make them once.
- Auth: `Authorization: Bearer KEY` (what OpenAI clients send) or the Tinker `X-API-Key`.
- Errors leave in OpenAI's shape (`errors.respond` picks it by the `/v1/` prefix): 401 bad
  key, 404 unknown model, 400 bad or unsupported arguments; a sample that fails in the
  sampler is a 400 when its category is `user`, else a 500.
- Logprobs are the sampler's: log p(token) under the model's raw distribution (temperature
  1, unfiltered), and only the sampled token's; a top-logprobs request is answered with
  that one token (the sampler computes no alternatives for sampled positions).
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Optional

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from eventing import topics
from eventing.store.event_store import Dedup
from functions.gateway import openai_wire as wire
from functions.gateway import quotas
from functions.gateway.context import SOURCE, GatewayContext
from functions.gateway.deps import bearer_or_api_key, get_ctx, read_body, tenant_of_key
from functions.gateway.openai_reply import Reply, stream
from functions.gateway.openai_text import Completion, TextCodec, TextCodecs, finish
from functions.gateway.routes.sampling import MAX_NUM_SAMPLES, checkpoint_weights
from functions.gateway.submit import submit
from openrl_core.errors import InvalidRequest, NotFound, OpenRLError, ServerError, Unauthorized
from openrl_core.events import new_event
from openrl_core.events.lifecycle import BlobRef
from openrl_core.events.sampling import (
    SAMPLE,
    SAMPLE_CANCEL_REQUESTED,
    SAMPLING_SESSION_CREATED,
    SampleCancelRequested,
    SampleRequested,
    SamplingSessionCreated,
)
from openrl_core.events.sessions import SESSION_CREATED, SessionCreated
from openrl_core.futures import FutureState, is_terminal
from openrl_core.ids import new_request_id, sampling_session_id_for
from openrl_core.params import SamplingParams
from openrl_core.quotas import Cost, sampling_tokens

router = APIRouter(prefix="/v1")


class ClientGone(OpenRLError):
    """The client closed the connection while its samples were still running."""

    category = "user"
    http_status = 499  # nginx's "client closed request": nobody is there to read it


SESSION_NAMESPACE = uuid.UUID("5b0c5f8e-8d1e-4d59-9a57-0f3c1d6e2a41")  # fixed: a tenant's session id must not change


async def openai_tenant(request: Request) -> str:  # async: no I/O, so no worker-thread hop (see deps)
    api_key = bearer_or_api_key(request)
    if not api_key:
        raise Unauthorized("missing API key: send it as 'Authorization: Bearer KEY'")
    return tenant_of_key(request.app.state.ctx, api_key)


def codecs(request: Request) -> TextCodecs:
    state = request.app.state
    if getattr(state, "openai_codecs", None) is None:
        state.openai_codecs = TextCodecs(state.ctx.models)
    return state.openai_codecs


# -- models -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """What a `model` string samples from."""

    name: str
    base_model: str
    adapter: Optional[dict[str, BlobRef]] = None
    weights: Optional[BlobRef] = None  # a full fine-tuning run's published weights
    model_path: Optional[str] = None


def resolve_model(ctx: GatewayContext, tenant: str, model: str) -> Target:
    missing = wire.ModelNotFound(f"The model {model!r} does not exist or you do not have access to it.")
    if model.startswith("tinker://"):
        try:
            base_model, adapter, weights = checkpoint_weights(ctx, tenant, model)
        except NotFound:
            raise missing from None
        except InvalidRequest as malformed:
            if "full fine-tuning training state" in malformed.detail:
                raise
            raise missing from None  # a malformed path names no model, same as a missing one
        return Target(model, base_model, adapter, weights, model)
    if model not in ctx.models.catalog.names():
        raise missing
    return Target(model, model)


@router.get("/models")
def list_models(ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(openai_tenant)) -> dict:
    cards = [wire.model_card(name, 0, "openrl") for name in ctx.models.catalog.names()]
    rows, _total = ctx.projections.live_checkpoints(tenant, datetime.now(timezone.utc), kind="sampler_weights")
    cards += [wire.model_card(row.tinker_path, int(row.created_at.timestamp()), tenant) for row in rows]
    return {"object": "list", "data": cards}


@router.get("/models/{model:path}")
def get_model(model: str, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(openai_tenant)) -> dict:
    target = resolve_model(ctx, tenant, model)
    return wire.model_card(target.name, 0, tenant if target.model_path else "openrl")


# -- the endpoint's session and sampling sessions -----------------------------------------------


def endpoint_session(ctx: GatewayContext, tenant: str) -> str:
    session_id = str(uuid.uuid5(SESSION_NAMESPACE, tenant))
    if ctx.projections.session(tenant, session_id) is None:
        payload = SessionCreated(session_id=session_id, tags=["openai"], display_name="OpenAI-compatible endpoint")
        event = new_event(SESSION_CREATED, payload, tenant=tenant, source=SOURCE, key=session_id, subject=session_id)
        ctx.emit(event, dedup=Dedup.of(f"openai-session:{session_id}", b""))
    return session_id


def sampling_session(ctx: GatewayContext, tenant: str, target: Target) -> str:
    """The sampling session of this `model` string: its seq id is a hash of the string, moved
    on past any (vanishingly rare) session that another string already holds."""
    session_id = endpoint_session(ctx, tenant)
    seq = int(hashlib.sha256(target.name.encode()).hexdigest()[:7], 16)
    while True:
        sampling_session_id = sampling_session_id_for(session_id, seq)
        row = ctx.projections.sampling_session(tenant, sampling_session_id)
        if row is None:
            break
        if row.base_model == target.base_model and row.model_path == target.model_path:
            return sampling_session_id
        seq += 1
    payload = SamplingSessionCreated(
        sampling_session_id=sampling_session_id,
        session_id=session_id,
        sampling_session_seq_id=seq,
        base_model=target.base_model,
        model_path=target.model_path,
        adapter=target.adapter,
        weights=target.weights,
    )
    event = new_event(SAMPLING_SESSION_CREATED, payload, tenant=tenant, source=SOURCE, key=sampling_session_id)
    ctx.emit(event, dedup=Dedup.of(f"sampler:{sampling_session_id}", target.name.encode()))
    return sampling_session_id


# -- one request: validate, submit, await ------------------------------------------------------


@dataclass
class Job:
    ctx: GatewayContext
    tenant: str
    target: Target
    codec: TextCodec
    prompts: list[list[int]]
    n: int
    params: SamplingParams
    sampling_session_id: str = ""
    request_ids: tuple[str, ...] = ()

    @property
    def stops(self) -> Optional[list[str]]:
        return self.params.stop_strings() or None


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    for index, tokens in enumerate(prompts):
        if not tokens:
            raise InvalidRequest(f"prompt {index} holds no tokens")
        bad = next((t for t in tokens if t < 0 or t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"prompt {index} holds token id {bad}, outside the vocabulary [0, {vocab_size})")


def sampling_params(body: wire.SamplingArgs, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        seed=body.seed,
        stop=body.stop_strings(),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
    )


def fit_context(prompts: list[list[int]], max_tokens: Optional[int], max_context: int) -> int:
    longest = max(len(p) for p in prompts)
    if longest >= max_context:
        raise InvalidRequest(
            f"This model's maximum context length is {max_context} tokens; the prompt holds {longest}."
        )
    if max_tokens is None:
        return max_context - longest
    if longest + max_tokens > max_context:
        raise InvalidRequest(
            f"This model's maximum context length is {max_context} tokens; the prompt ({longest} tokens) "
            f"plus max_tokens ({max_tokens}) exceeds it."
        )
    return max_tokens


def submit_job(job: Job) -> None:
    """Admitted whole against the tenant's quotas (every prompt's samples, before the sampling
    session is made), so a refused request stores nothing and an admitted one is not cut."""
    budget = job.params.max_tokens or 0
    cost = sum((Cost(requests=1, sampling_tokens=sampling_tokens(len(p), budget, job.n)) for p in job.prompts), Cost())
    with quotas.admitted(job.ctx, job.tenant, cost):
        _submit_job(job)


def _submit_job(job: Job) -> None:
    job.sampling_session_id = sampling_session(job.ctx, job.tenant, job.target)
    ids = []
    for prompt in job.prompts:
        request_id = new_request_id()
        payload = SampleRequested(
            request_id=request_id,
            sampling_session_id=job.sampling_session_id,
            seq_id=0,
            base_model=job.target.base_model,
            adapter=job.target.adapter,
            weights=job.target.weights,
            prompt_tokens=prompt,
            num_samples=job.n,
            sampling_params=job.params,
            sample_sequence_ids=[f"{request_id}:{i}" for i in range(job.n)],
        )
        kwargs = dict(
            stream="sampling", base_model=job.target.base_model, key=job.sampling_session_id, dedup=None, admit=False
        )
        ids.append(submit(job.ctx, job.tenant, SAMPLE["requested"], payload, **kwargs).request_id)
    job.request_ids = tuple(ids)


async def await_sample(ctx: GatewayContext, tenant: str, request_id: str, request: Request) -> dict:
    """The finished sample's result; a failed one raises. The long-poll window only bounds
    each wait, so a client that went away is noticed and its sample dropped."""
    with ctx.waiters.watch(request_id) as woken:
        while True:
            woken.clear()  # before reading, so a completion during the read still wakes us
            row = await run_in_threadpool(ctx.projections.future, tenant, request_id)
            if row is not None and is_terminal(FutureState(row.state)):
                break
            try:
                await asyncio.wait_for(woken.wait(), timeout=ctx.settings.long_poll_seconds)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise ClientGone(f"the client went away before sample {request_id!r} finished")
    state = FutureState(row.state)
    if state is FutureState.COMPLETED:
        return row.result
    error = row.error or ("the sample was cancelled" if state is FutureState.CANCELLED else "the sample failed")
    raise (InvalidRequest if row.category == "user" else ServerError)(f"sampling failed: {error}")


async def await_job(job: Job, request: Request) -> list[Completion]:
    """Every choice, in OpenAI's order (prompt by prompt, n each); cancels what is left if the
    client goes away first."""
    waits = [asyncio.ensure_future(await_sample(job.ctx, job.tenant, rid, request)) for rid in job.request_ids]
    try:
        results = await asyncio.gather(*waits)
    except BaseException:  # a failed sample, a client gone, or this task cancelled
        for wait in waits:
            wait.cancel()
        # Not awaited: in a cancelled task every await raises again, and the cancels must go out.
        cancel_job(job)
        raise
    choices = []
    for result in results:
        for sequence in result["sequences"]:
            choices.append(
                finish(
                    sequence["tokens"],
                    sequence["logprobs"],
                    sequence["stop_reason"],
                    job.stops,
                    job.codec.eos_ids,
                    job.codec.decode,
                )
            )
    return choices


def cancel_job(job: Job) -> None:
    """Ask the sampler to drop the job's unfinished samples (one it has started runs to its end)."""
    where = topics.topic(job.tenant, "sampling", job.ctx.models.canonical(job.target.base_model))
    for request_id in job.request_ids:
        row = job.ctx.projections.future(job.tenant, request_id)
        if row is None or is_terminal(FutureState(row.state)):
            continue
        payload = SampleCancelRequested(request_id=request_id, sampling_session_id=job.sampling_session_id)
        event = new_event(
            SAMPLE_CANCEL_REQUESTED,
            payload,
            tenant=job.tenant,
            source=SOURCE,
            key=job.sampling_session_id,
            subject=request_id,
        )
        job.ctx.emit(event, where, Dedup.of(f"cancel:{request_id}", b""))


async def prepare(request: Request, body: wire.SamplingArgs, tenant: str, prompts_of, max_tokens: Optional[int]) -> Job:
    refused = body.unsupported()
    if refused:
        raise InvalidRequest(f"not supported by this server: {', '.join(refused)}")
    ctx: GatewayContext = request.app.state.ctx
    target = await run_in_threadpool(resolve_model, ctx, tenant, body.model)
    codec = await run_in_threadpool(codecs(request).get, target.base_model)
    prompts = await run_in_threadpool(prompts_of, codec)
    files = ctx.models.files(target.base_model)
    check_prompts(prompts, files.vocab_size)
    n = body.n or 1
    if len(prompts) * n > MAX_NUM_SAMPLES:
        raise InvalidRequest(
            f"at most {MAX_NUM_SAMPLES} choices per request (prompts x n); asked for {len(prompts) * n}"
        )
    if body.stop is not None and isinstance(body.stop, list) and len(body.stop) > wire.MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"stop holds at most {wire.MAX_STOP_SEQUENCES} sequences")
    if any(s == "" for s in body.stop_strings() or ()):
        raise InvalidRequest("stop sequences must be non-empty")
    params = sampling_params(body, fit_context(prompts, max_tokens, files.max_context))
    job = Job(ctx, tenant, target, codec, prompts, n, params)
    await run_in_threadpool(submit_job, job)
    return job


# -- routes -----------------------------------------------------------------------------------


def completion_prompts(body: wire.CompletionRequest):
    prompt = body.prompt

    def encode(codec: TextCodec) -> list[list[int]]:
        if isinstance(prompt, str):
            return [codec.encode(prompt)]
        if not prompt:
            raise InvalidRequest("prompt is an empty list")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return [codec.encode(p) if isinstance(p, str) else list(p) for p in prompt]

    return encode


@router.post("/completions")
async def completions(request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(openai_tenant)):
    body = wire.CompletionRequest.model_validate_json(await read_body(request, ctx.settings.max_request_bytes))
    job = await prepare(request, body, tenant, completion_prompts(body), body.max_tokens or 16)
    return await answer(job, request, body, body.logprobs, chat=False)


@router.post("/chat/completions")
async def chat_completions(
    request: Request, ctx: GatewayContext = Depends(get_ctx), tenant: str = Depends(openai_tenant)
):
    body = wire.ChatCompletionRequest.model_validate_json(await read_body(request, ctx.settings.max_request_bytes))
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    job = await prepare(request, body, tenant, lambda codec: [codec.chat_prompt(messages)], body.token_limit())
    return await answer(job, request, body, (body.top_logprobs or 0) if body.logprobs else None, chat=True)


async def answer(job: Job, request: Request, body: wire.SamplingArgs, logprobs: Optional[int], chat: bool):
    prompt_tokens = sum(len(p) for p in job.prompts)  # each prompt once, whatever n is
    reply = Reply(job.request_ids[0], body.model, job.codec, prompt_tokens, logprobs, chat)
    if body.stream:
        return stream(reply, await_job(job, request), bool(body.stream_options and body.stream_options.include_usage))
    return reply.whole(await await_job(job, request))
