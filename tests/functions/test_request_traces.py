"""The projector's request tracer (functions/request_traces.py) over a real SQLite event store,
posting to a real OTLP/HTTP receiver on loopback: a failed request's trace carries an error
status and one `worker (queued and run)` child where the worker recorded no start; an
endpoint that is stuck never slows `observe` (the projector's side) nor keeps stop waiting
past the exporter's timeout; a full queue drops traces and counts them.
"""

from __future__ import annotations

import threading
import time

import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from eventing.blobs import BlobStore
from eventing.codec import Codec
from eventing.store import database
from eventing.store.event_store import EventStore
from functions import request_traces
from functions.request_traces import RequestTracer, traces_url
from openrl_core import request_spans
from openrl_core.events import training
from openrl_core.events.base import new_event
from openrl_core.events.lifecycle import RequestFailed
from openrl_core.events.training import OptimStepRequested
from openrl_core.params import AdamParams
from tests.functions.otlp_receiver import Receiver, attributes


@pytest.fixture
def store(tmp_path):
    engine = database.make_engine(f"sqlite:///{tmp_path / 'events.db'}")
    database.upgrade(engine)
    yield EventStore(engine, Codec(BlobStore(tmp_path / "blobs")))
    engine.dispose()


def failed_optim_step(store: EventStore, request_id: str):
    """A request the gateway stored and a worker failed; returns both stored events."""
    payload = OptimStepRequested(request_id=request_id, model_id="m1", seq_id=1, adam_params=AdamParams())
    requested = new_event(training.OPTIM_STEP["requested"], payload, tenant="alice", source="/openrl/gateway",
                          key="m1", subject=request_id)  # fmt: skip
    store.append(requested)
    failed = new_event(training.OPTIM_STEP["failed"], RequestFailed(request_id=request_id, error="bad lr", category="user"),
                       tenant="alice", source="/openrl/trainer", key="m1", subject=request_id, lease=3)  # fmt: skip
    store.append_batch([(failed, None)])
    return requested, failed


def running(tracer: RequestTracer):
    stop = threading.Event()
    thread = threading.Thread(target=tracer.run, args=(stop,), daemon=True)
    thread.start()
    return stop, thread


def test_endpoint_url():
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://x.example/otlp/v1/traces") == "https://x.example/otlp/v1/traces"


def test_a_failed_request_without_a_start(store):
    receiver = Receiver()
    try:
        _, failed = failed_optim_step(store, "req-f")
        tracer = RequestTracer(store, receiver.url, "svc")
        stop, thread = running(tracer)
        tracer.observe([failed])
        trace_id = request_spans.trace_id_of("req-f").to_bytes(16, "big")
        assert receiver.wait_for(lambda: len([s for _, s in receiver.spans if s.trace_id == trace_id]) == 3)
        stop.set()
        thread.join(10)
    finally:
        receiver.close()
    spans = {span.name: span for _, span in receiver.spans}
    assert set(spans) == {"optim_step", "worker (queued and run)", "projector (store)"}
    root = spans["optim_step"]
    assert root.status.code == Status.STATUS_CODE_ERROR and root.status.message == "user: bad lr"
    assert spans["worker (queued and run)"].status.code == Status.STATUS_CODE_UNSET
    assert spans["worker (queued and run)"].end_time_unix_nano == round(failed.time.timestamp() * 1e6) * 1000
    assert attributes(root)["openrl.outcome"] == "failed" and attributes(root)["openrl.lease_id"] == 3


def test_a_stuck_endpoint_never_holds_the_projector(store, monkeypatch):
    monkeypatch.setattr(request_traces, "EXPORT_TIMEOUT_S", 1.0)
    receiver = Receiver(hang_s=60)
    try:
        _, failed = failed_optim_step(store, "req-s")
        tracer = RequestTracer(store, receiver.url, "svc")
        stop, thread = running(tracer)
        began = time.perf_counter()
        for _ in range(200):
            tracer.observe([failed])  # the projector's side: a filter and a queue put
        observed_s = time.perf_counter() - began
        assert receiver.wait_for(lambda: receiver.posts >= 1, timeout=10), "the exporter posted and is now held"
        tracer.observe([failed])
        assert observed_s < 0.5, observed_s
        began = time.perf_counter()
        stop.set()
        thread.join(request_traces.EXPORT_TIMEOUT_S * 3 + 5)
        assert not thread.is_alive(), "stop waits for the exporter's timeout, not for the endpoint"
        assert time.perf_counter() - began < request_traces.EXPORT_TIMEOUT_S * 3 + 5
    finally:
        receiver.close()


def test_a_full_queue_drops_and_counts(store, monkeypatch):
    monkeypatch.setattr(request_traces, "QUEUE_LIMIT", 2)
    requested_event, failed = failed_optim_step(store, "req-q")
    tracer = RequestTracer(store, "http://127.0.0.1:9/v1/traces", "svc")  # never run: nothing drains
    for _ in range(4):
        tracer.observe([failed, requested_event])
    assert tracer.dropped == 2  # two batches past the limit, one terminal event each
    tracer.provider.shutdown()


def test_the_knative_projector_function_traces_what_it_stores(tmp_path, monkeypatch):
    """`openrl function projector` under func-python, fed as a KafkaSource delivers (each
    event once, then two again): one trace per finished request, at the events' own times;
    the redeliveries store nothing and export nothing again."""
    from tests.functions.audit.scenario import Stream
    from tests.functions.test_kafkasource_delivery import Served, kafka_source_deliveries, post_all, realistic

    monkeypatch.delenv("OPENRL_OTEL_ENDPOINT", raising=False)
    events = realistic(Stream("alice"))
    by_subject = {}
    for event in events:
        by_subject.setdefault(event.subject, {})[event.type.split(".")[4]] = event
    receiver = Receiver()
    served = Served("projector", tmp_path, OPENRL_DATABASE_URL=f"sqlite:///{tmp_path / 'events.db'}",
                    OPENRL_OTEL_ENDPOINT=receiver.url)  # fmt: skip
    try:
        answers = post_all(served.url, kafka_source_deliveries(Codec(BlobStore(tmp_path / "blobs")), events))
        assert [a.status_code for a in answers] == [200] * (len(events) + 2)
        assert receiver.wait_for(lambda: len(receiver.spans) >= 6)
    finally:
        served.stop()
        receiver.close()
    for request_id in ("req-create", "req-fb"):
        trace_id = request_spans.trace_id_of(request_id).to_bytes(16, "big")
        spans = {span.name: span for _, span in receiver.spans if span.trace_id == trace_id}
        verb = by_subject[request_id]["requested"].type.split(".")[3]
        assert set(spans) == {verb, "worker (queued and run)", "projector (store)"}, spans
        nanos = {phase: round(e.time.timestamp() * 1e6) * 1000 for phase, e in by_subject[request_id].items()}
        assert spans[verb].start_time_unix_nano == nanos["requested"]
        assert spans["worker (queued and run)"].end_time_unix_nano == nanos["completed"]
    assert len(receiver.spans) == 6, "the redelivered events exported nothing again"


def test_the_setting(monkeypatch):
    from pydantic import ValidationError

    from openrl_core.settings import Settings

    monkeypatch.delenv("OPENRL_OTEL_ENDPOINT", raising=False)
    assert Settings().otel_endpoint is None  # off by default
    monkeypatch.setenv("OPENRL_OTEL_ENDPOINT", "")
    assert Settings().otel_endpoint is None  # set but empty is off too
    monkeypatch.setenv("OPENRL_OTEL_ENDPOINT", "http://collector:4318")
    assert Settings().otel_endpoint == "http://collector:4318"
    monkeypatch.setenv("OPENRL_OTEL_ENDPOINT", "collector:4318")
    with pytest.raises(ValidationError, match="http:// or https:// URL"):
        Settings()


def test_stopping_exports_everything_the_projector_had_stored(store):
    """Three stored batches of 256 finished requests, then stop at once: every trace is posted
    (more than one drain's worth, and more spans than the SDK's default queue holds)."""
    from openrl_core.events.lifecycle import RequestCompleted

    batches = []
    for b in range(3):
        ids = [f"req-{b}-{i}" for i in range(256)]
        requested = [new_event(training.OPTIM_STEP["requested"], OptimStepRequested(request_id=r, model_id="m1", seq_id=1,
                     adam_params=AdamParams()), tenant="alice", source="/g", key="m1", subject=r) for r in ids]  # fmt: skip
        completed = [new_event(training.OPTIM_STEP["completed"], RequestCompleted(request_id=r, result={}),
                               tenant="alice", source="/w", key="m1", subject=r) for r in ids]  # fmt: skip
        store.append_batch([(event, None) for event in requested + completed])
        batches.append(completed)
    receiver = Receiver()
    try:
        tracer = RequestTracer(store, receiver.url, "svc")
        for completed in batches:
            tracer.observe(completed)
        stop = threading.Event()
        stop.set()
        tracer.run(stop)  # drains the queue, then the SDK posts what it holds
        roots = {span.trace_id for _, span in receiver.spans if not span.parent_span_id}
    finally:
        receiver.close()
    assert tracer.exported == 768 and len(roots) == 768 and len(receiver.spans) == 3 * 768
