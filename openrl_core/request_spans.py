"""One request's path as trace spans, folded from its stored events. Pure: no I/O, no OpenTelemetry.

The events the system keeps already say where a request spent its time: the gateway's
`…requested` (when it was queued on the log), the worker's `…started` or, for the trainer,
the `started` its completion records (when it got the model and a timeslicer turn), the
worker's `…completed`/`…failed` (when it finished) and the moment the projector stored that
terminal event (after which the client's long-poll answers). `openrl_core.session_trace`
folds the first three per request; this module turns one folded request into spans:

    <verb>                       requested -> stored (the whole path the client waits on)
      gateway→log (queued)       requested -> started
      worker (run)               started   -> finished
      projector (store)          finished  -> stored

A request whose worker recorded no start (the sampler) has one `worker (queued and run)`
child from requested to finished instead of the first two. The root ends when the terminal
event was stored, so it covers every child (trace viewers shift children that stick out).

Ids are derived from the request id alone (SHA-256), never drawn at random: the trace id
from the request id, each span id from the request id and the span's name. A redelivered
terminal event therefore re-exports the very same trace and span ids (a backend keeps one
trace, possibly with the spans twice), never a second, different trace of one request.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime
from typing import Optional, Union

from openrl_core.session_trace import Request

QUEUED = "gateway→log (queued)"
RUN = "worker (run)"
QUEUED_AND_RUN = "worker (queued and run)"
STORE = "projector (store)"

Attribute = Union[str, int]


@dataclass(frozen=True)
class SpanSpec:
    """What an exporter needs of one span; times are the stored events' own."""

    name: str
    trace_id: int  # 128 bits, never 0 (0 is OpenTelemetry's "invalid")
    span_id: int  # 64 bits, never 0
    parent_id: Optional[int]
    start: datetime
    end: datetime
    attributes: dict[str, Attribute] = field(default_factory=dict)
    error: Optional[str] = None  # set on a failed request's root: the span's status is an error


def _digest(*parts: str) -> bytes:
    return hashlib.sha256("\0".join(("openrl.request_spans.v1", *parts)).encode()).digest()


def trace_id_of(request_id: str) -> int:
    return int.from_bytes(_digest("trace", request_id)[:16], "big") or 1


def span_id_of(request_id: str, name: str) -> int:
    return int.from_bytes(_digest("span", request_id, name)[:8], "big") or 1


def attributes_of(request: Request, tenant: str) -> dict[str, Attribute]:
    out: dict[str, Attribute] = {
        "openrl.tenant": tenant,
        # The partition key: the model id of a training request, the sampling session id of a sample.
        "openrl.model_id": request.key,
        "openrl.request_id": request.request_id,
        "openrl.family": request.family,
        "openrl.outcome": request.outcome or "open",
    }
    if request.worker is not None:
        out["openrl.worker"] = request.worker
    if request.lease_id is not None:
        out["openrl.lease_id"] = int(request.lease_id)
    return out


def spans_of(request: Request, tenant: str, stored: datetime, error: Optional[str] = None) -> list[SpanSpec]:
    """The spans of one finished request (root first); none for one not finished or never
    requested (a `…completed` with nothing before it is a record, not a request)."""
    begin = request.requested or request.started
    if request.finished is None or begin is None:
        return []
    trace_id = trace_id_of(request.request_id)
    root_id = span_id_of(request.request_id, request.verb)
    attributes = attributes_of(request, tenant)
    end = max(request.finished, stored)

    def child(name: str, start: datetime, stop: datetime) -> SpanSpec:
        return SpanSpec(name, trace_id, span_id_of(request.request_id, name), root_id, start, stop, attributes)

    spans = [SpanSpec(request.verb, trace_id, root_id, None, begin, end, attributes, error)]
    if request.started is not None:
        if request.requested is not None:
            spans.append(child(QUEUED, request.requested, request.started))
        spans.append(child(RUN, request.started, request.finished))
    else:
        spans.append(child(QUEUED_AND_RUN, begin, request.finished))
    spans.append(child(STORE, request.finished, end))
    return spans
