"""The projector as a Knative function: a KafkaSource POSTs each worker event; it is stored once, then long-polls wake.

The deployment runs the projector as a Deployment that consumes Kafka itself
(`openrl projector`, `eventing.projector`): it stores a batch per transaction and commits
offsets after the store (knative/README.md says why that is the default). This function is
the same fold for KafkaSource delivery: `handle` decodes the CloudEvent (binary mode), appends
it to the event store (a redelivered CloudEvent id is a no-op), and only after the store has
committed wakes the long-polls of its request (PostgreSQL NOTIFY in the distributed
deployment) and answers 200. It answers 2xx for an event it stored or already had, so the
source never redelivers one forever; an event that cannot be stored is a 5xx, retried.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Optional

from eventing.blobs import BlobStore
from eventing.codec import Codec
from eventing.notify import LocalNotifier
from eventing.store import database
from eventing.store.event_store import EventStore
from functions import event_asgi as asgi


class ProjectorFunction:
    """func-python shape: handle(scope, receive, send) plus start/stop/alive/ready."""

    def __init__(self, store: Optional[EventStore] = None, notifier=None) -> None:
        self.store = store
        self.notifier = notifier
        self._engine = None
        self.tracer = None  # the optional OpenTelemetry traces (otel_endpoint), on a thread of their own
        self._tracer_stop = threading.Event()
        self._tracer_thread: Optional[threading.Thread] = None

    def start(self, cfg: dict) -> None:
        settings = asgi.settings_from(cfg)
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        self._engine = database.make_engine(settings.resolved_database_url())
        database.upgrade(self._engine)
        codec = Codec(BlobStore(settings.data_dir / "blobs"), settings.inline_payload_limit)
        self.store = EventStore(self._engine, codec)
        if self._engine.dialect.name == "postgresql":
            from eventing.pg_notify import PgNotifier

            self.notifier = PgNotifier(self._engine.url.render_as_string(hide_password=False))
            self.store.announce_runs()  # the gateways' kept runs (eventing/store/known_runs.py)
        else:
            self.notifier = LocalNotifier()
        if settings.otel_endpoint:  # only then is OpenTelemetry's SDK imported
            from functions.request_traces import RequestTracer

            self.tracer = RequestTracer.from_settings(settings, self.store)
            self._tracer_thread = threading.Thread(target=self.tracer.run, args=(self._tracer_stop,), daemon=True)
            self._tracer_thread.start()

    def stop(self) -> None:
        if self._tracer_thread is not None:
            self._tracer_stop.set()
            self._tracer_thread.join(timeout=30)
        if self.notifier is not None and hasattr(self.notifier, "close"):
            self.notifier.close()
        if self._engine is not None:
            self._engine.dispose()

    def alive(self) -> tuple[bool, str]:
        return True, "alive"

    def ready(self) -> tuple[bool, str]:
        started = self.store is not None
        return started, ("ready" if started else "starting")

    async def handle(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await asgi.lifespan(receive, send)
            return
        if self.store is None:
            raise RuntimeError("projector function not started")
        request = await asgi.read_request(scope, receive)
        if request.method != "POST":
            await asgi.respond_json(send, 405, {"detail": "POST a CloudEvent (binary mode) to store it"})
            return
        event = await asgi.event_or_answer(self.store.codec, request, send)
        if event is None:
            return
        appended = await asyncio.to_thread(self.store.append, event)
        request_id = getattr(event.data, "request_id", None)
        if appended.stored and request_id:
            # Its row goes along if finished: the gateways answer from it (eventing/pg_notify.py).
            await asyncio.to_thread(self.notifier.notify, [request_id], self.store.finished.peek_many([request_id]))
        if appended.stored and self.tracer is not None:
            self.tracer.observe([event])  # never blocks: the trace is built on the tracer's thread
        await asgi.respond_json(send, 200, {"id": event.id, "stored": bool(appended.stored)})


def new() -> ProjectorFunction:
    return ProjectorFunction()
