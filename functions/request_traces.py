"""Optional OpenTelemetry traces of each request's path, exported over OTLP/HTTP (`otel_endpoint`).

Nothing is instrumented hop by hop: the events the store already holds say when a request
was queued (the gateway's `…requested`), began (`…started`, or the trainer's
`details.started`) and finished (the worker's terminal event), and the projector knows when
it stored that terminal event. So the projector hands each batch it stored to `observe`,
and once a request's terminal event is stored its trace is built from its stored events
(`openrl_core.request_spans`: root `<verb>`, children `gateway→log (queued)`,
`worker (run)`, `projector (store)`) with trace and span ids derived from the request id.

Off the projector's hot path, and never a cause of its failure: `observe` only filters and
puts the stored batch on a bounded queue, one put per batch (a full queue drops the batch's
traces and counts them); the store
read, the span building and the export run on this loop's own thread, and the SDK's batch
processor posts to the endpoint from another, with a timeout, dropping what an endpoint that
is down cannot take. A redelivered terminal event is observed again and re-exports the same
trace and span ids (a backend shows the one trace, perhaps with its spans twice).

This module imports OpenTelemetry's SDK; nothing imports this module unless the setting is
set (functions/serve.py), so an unset endpoint costs nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
from datetime import datetime, timezone
from urllib.parse import urlparse

from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Status, StatusCode

from eventing.store.event_store import EventStore
from eventing.store.session_trace import SessionTrace
from openrl_core import request_spans, session_trace
from openrl_core.events.base import Event

log = logging.getLogger(__name__)
QUEUE_LIMIT = 1_000  # stored batches (up to 256 events each) waiting; past it, their traces are dropped
EXPORT_TIMEOUT_S = 5.0
SCHEDULE_DELAY_MS = 1000  # how long finished spans wait to be posted together


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP base (`http://collector:4318`) gets the traces path; a full URL is kept."""
    return endpoint.rstrip("/") + "/v1/traces" if urlparse(endpoint).path in ("", "/") else endpoint


class _DerivedIds(IdGenerator):
    """Hands out the ids `request_spans` derived: set `next` before each span is started.
    Only the tracer's own thread starts spans of its private provider."""

    def __init__(self) -> None:
        self.next = (1, 1)

    def generate_trace_id(self) -> int:
        return self.next[0]

    def generate_span_id(self) -> int:
        return self.next[1]


def _terminal(event: Event) -> bool:
    return event.subject is not None and event.type.split(".")[4:5] in (["completed"], ["failed"])


def _nanos(moment: datetime) -> int:
    return session_trace.micros(moment) * 1000  # exact: the store keeps microseconds


class RequestTracer:
    """A loop (run(stop)) beside the projector: builds and exports one trace per finished request."""

    def __init__(self, store: EventStore, endpoint: str, service_name: str = "openrl") -> None:
        self.reads = SessionTrace(store)
        self.dropped = 0  # terminal events whose trace was dropped (the queue was full)
        self._dropped_batches = 0
        self.exported = 0
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_LIMIT)  # read when built: tests lower it
        self._ids = _DerivedIds()
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}), id_generator=self._ids, sampler=ALWAYS_ON
        )
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=EXPORT_TIMEOUT_S)
        # Four spans a request: the SDK's default queue (2048 spans) would drop a burst of 512.
        processor = BatchSpanProcessor(exporter, max_queue_size=16_384, schedule_delay_millis=SCHEDULE_DELAY_MS)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("openrl.projector")

    @classmethod
    def from_settings(cls, settings, store: EventStore) -> "RequestTracer":
        return cls(store, settings.otel_endpoint, settings.otel_service_name)

    def observe(self, events: list[Event]) -> None:
        """Called by the projector after its store committed `events` (a list it no longer
        changes); never blocks or raises. One queue put per batch: the filtering is done on
        the tracer's thread."""
        try:
            self._queue.put_nowait((events, datetime.now(timezone.utc)))
        except queue.Full:
            self.dropped += sum(1 for event in events if _terminal(event))
            self._dropped_batches += 1
            if self._dropped_batches == 1 or self._dropped_batches % 1000 == 0:
                log.warning("otel: %d request traces dropped (the export falls behind)", self.dropped)
        except Exception:  # a trace is never worth a projection
            log.exception("otel: observing a stored batch failed")

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                self._export_waiting(timeout=0.5)
            while not self._queue.empty():  # what the projector stored before it stopped
                self._export_waiting(timeout=0)
        finally:
            self.provider.shutdown()  # posts what is buffered, within the exporter's timeout

    def _export_waiting(self, timeout: float) -> None:
        batch = []
        try:
            item = self._queue.get(timeout=timeout) if timeout else self._queue.get_nowait()
            while True:
                events, stored = item
                batch.extend((event, stored) for event in events if _terminal(event))
                if len(batch) >= 512:
                    break
                item = self._queue.get_nowait()
        except queue.Empty:
            pass
        if batch:
            try:
                self.export(batch)
            except Exception:
                log.exception("otel: building %d request traces failed", len(batch))

    def export(self, batch: list[tuple[Event, datetime]]) -> None:
        """Build the traces of these stored terminal events from the store and hand them to the SDK."""
        by_tenant: dict[str, dict[str, set[str]]] = {}
        terminal: dict[tuple[str, str], tuple[Event, datetime]] = {}
        for event, stored in batch:
            by_tenant.setdefault(event.tenant, {}).setdefault(event.key or "", set()).add(event.subject)
            terminal.setdefault((event.tenant, event.subject), (event, stored))
        for tenant, keyed in by_tenant.items():
            for request in session_trace.requests_of(self.reads.request_envelopes(tenant, keyed)):
                found = terminal.get((tenant, request.request_id))
                if found is None:
                    continue
                event, stored = found
                error = None
                if request.outcome == "failed":
                    error = f"{getattr(event.data, 'category', 'server')}: {getattr(event.data, 'error', '')}"
                self._emit(request_spans.spans_of(request, tenant, stored, error))

    def _emit(self, specs: list[request_spans.SpanSpec]) -> None:
        if not specs:
            return
        root_spec, children = specs[0], specs[1:]
        self._ids.next = (root_spec.trace_id, root_spec.span_id)
        root = self.tracer.start_span(
            root_spec.name, context=otel_context.Context(), attributes=root_spec.attributes,
            start_time=_nanos(root_spec.start),
        )  # fmt: skip
        parent = otel_trace.set_span_in_context(root, otel_context.Context())
        for spec in children:
            self._ids.next = (spec.trace_id, spec.span_id)
            span = self.tracer.start_span(
                spec.name, context=parent, attributes=spec.attributes, start_time=_nanos(spec.start)
            )
            span.end(end_time=_nanos(spec.end))
        if root_spec.error is not None:
            root.set_status(Status(StatusCode.ERROR, root_spec.error))
        root.end(end_time=_nanos(root_spec.end))
        self.exported += 1
