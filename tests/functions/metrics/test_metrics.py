"""The metrics function over the real embedded log and real catalogue events: exact counters,
histograms from known event times, queue depth, tokens, redelivery and restarts, and the
HTTP path. Values are read back from the served Prometheus text, as a scraper would."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from datetime import timedelta

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from eventing.blobs import BlobStore
from eventing.bus import EventPublisher
from eventing.codec import Codec
from eventing.embedded_log import EmbeddedLog
from functions.metrics import Metrics, MetricsService, new
from functions.metrics.state import BUCKETS
from openrl_core.settings import Settings
from tests.functions.audit.scenario import BASE, T0, Stream

CHECKPOINT_NEVER = 3600.0  # tests save explicitly
RATE_WINDOW = 120.0  # longer than the scenario, so every token event is in it at t=30


@pytest.fixture
def rig(tmp_path):
    log = EmbeddedLog(tmp_path / "log.db", fsync=False)
    codec = Codec(BlobStore(tmp_path / "blobs"))
    yield log, codec, EventPublisher(log, codec)
    log.close()


def timed(stream: Stream) -> None:
    """Known latencies: create 0.25 s; fb 0.5 s; failed fb 0.03125 s; save 60 s; sample 4 ms;
    forward-only 0.125 s; one fb left open. Event times have microsecond resolution."""
    s = stream
    s.completed(s.create_model("req-create", 0), 0.25, {"model_id": s.model})
    s.completed(s.forward_backward("req-fb-1", 1, lengths=(5, 7)), 1.5)
    s.failed(s.forward_backward("req-fb-2", 2), 2.03125, "token id out of range", category="user")
    s.forward_backward("req-fb-3", 3, lengths=(4,))  # still queued
    s.saved(s.save_weights("req-save", 4), 64)
    s.sampled(s.sample("req-sample", 5), 5.004, lengths=(3, 2))
    s.completed(s.forward_backward("req-fwd", 6, lengths=(9,), forward_only=True), 6.125)


def service(log, codec, path, clock=None) -> MetricsService:
    metrics = Metrics.load(path, dedup_window=1000, rate_window=RATE_WINDOW, **({"clock": clock} if clock else {}))
    return MetricsService(log, codec, metrics, port=0, checkpoint_seconds=CHECKPOINT_NEVER)


def drain(svc: MetricsService) -> None:
    while svc.run_once(timeout=0.05):
        pass


def scrape(text: bytes | str) -> dict[tuple[str, frozenset], float]:
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def req(type_: str, tenant: str = "alice") -> dict:
    return {"tenant": tenant, "base_model": BASE, "type": type_}


def at(seconds: float) -> float:
    return (T0 + timedelta(seconds=seconds)).timestamp()


def test_counters_histograms_depth_and_tokens_are_exact(rig, tmp_path):
    log, codec, publisher = rig
    timed(Stream("alice", publisher))
    svc = service(log, codec, tmp_path / "state.json", clock=lambda: at(30))
    drain(svc)
    m = scrape(svc.metrics.exposition())

    assert value(m, "openrl_requests_total", **req("forward_backward")) == 3
    assert value(m, "openrl_requests_total", **req("forward")) == 1
    assert value(m, "openrl_requests_completed_total", **req("forward_backward")) == 1
    assert value(m, "openrl_requests_failed_total", **req("forward_backward"), category="user") == 1
    for type_ in ("create_model", "save_weights", "sample", "forward"):
        assert value(m, "openrl_requests_total", **req(type_)) == 1
        assert value(m, "openrl_requests_completed_total", **req(type_)) == 1
    assert value(m, "openrl_queue_depth", **req("forward_backward")) == 1
    assert value(m, "openrl_queue_depth", **req("sample")) == 0

    expected = {  # (type, outcome): latency in seconds
        ("create_model", "completed"): 0.25, ("forward_backward", "completed"): 0.5,
        ("forward_backward", "failed"): 0.03125, ("save_weights", "completed"): 60.0,
        ("sample", "completed"): 0.004, ("forward", "completed"): 0.125,
    }  # fmt: skip
    for (type_, outcome), seconds in expected.items():
        labels = {"base_model": BASE, "type": type_, "outcome": outcome}
        assert value(m, "openrl_request_latency_seconds_count", **labels) == 1
        assert value(m, "openrl_request_latency_seconds_sum", **labels) == pytest.approx(seconds, abs=1e-6)
        for bound in BUCKETS:
            le = repr(bound)
            assert value(m, "openrl_request_latency_seconds_bucket", **labels, le=le) == (
                1 if seconds <= bound else 0
            ), le
        assert value(m, "openrl_request_latency_seconds_bucket", **labels, le="+Inf") == 1

    # Trained tokens: the completed forward_backward's 5 + 7 targets; not the failed one,
    # not the queued one, not the forward-only one. Sampled: 3 + 2 generated tokens.
    tokens = {"tenant": "alice", "base_model": BASE}
    assert value(m, "openrl_training_tokens_total", **tokens) == 12
    assert value(m, "openrl_sampled_tokens_total", **tokens) == 5
    assert value(m, "openrl_training_tokens_per_second", **tokens) == pytest.approx(12 / RATE_WINDOW)
    assert value(m, "openrl_sampled_tokens_per_second", **tokens) == pytest.approx(5 / RATE_WINDOW)
    assert value(m, "openrl_events_total", tenant="alice", type="training.forward_backward.requested") == 4
    # Request ids are never label values.
    assert not any(v.startswith("req-") for _, labels in m for _, v in labels)
    svc.close()

    later = service(log, codec, tmp_path / "state.json", clock=lambda: at(200))
    assert value(scrape(later.metrics.exposition()), "openrl_training_tokens_per_second", **tokens) == 0
    later.consumer.close()


def test_queue_depth_goes_up_and_down(rig, tmp_path):
    log, codec, publisher = rig
    stream = Stream("alice", publisher)
    svc = service(log, codec, tmp_path / "state.json")

    def depth(type_="forward_backward"):
        drain(svc)
        return value(scrape(svc.metrics.exposition()), "openrl_queue_depth", **req(type_))

    stream.create_model("req-0", 0)  # what names the model's base model
    first = stream.forward_backward("req-1", 1)
    second = stream.forward_backward("req-2", 2)
    assert depth() == 2
    stream.completed(first, 3)
    assert depth() == 1
    stream.failed(second, 4, "out of memory", category="server")
    assert depth() == 0  # the series stays, at zero
    sample = stream.sample("req-3", 5)
    assert depth("sample") == 1
    from openrl_core.events import sampling as se

    stream.emit(se.SAMPLE_CANCELLED, se.SampleCancelled(request_id="req-3"), t=6, source="/openrl/sampler",
                key=sample.key, stream="completions")  # fmt: skip
    assert depth("sample") == 0
    assert value(scrape(svc.metrics.exposition()), "openrl_requests_cancelled_total", **req("sample")) == 1
    svc.close()


def test_a_redelivered_event_is_counted_once(rig, tmp_path):
    log, codec, publisher = rig
    stream = Stream("alice", publisher)
    timed(stream)
    path = tmp_path / "state.json"
    reference = service(log, codec, tmp_path / "reference.json")
    drain(reference)
    exact = scrape(reference.metrics.exposition())
    reference.close()

    # Crash after the save but before the commit: everything is delivered again.
    first = service(log, codec, path)
    drain(first)
    first.metrics.save()
    first.consumer.close()
    second = service(log, codec, path)
    assert second.group == first.group  # the saved state's own group, resumed
    drain(second)
    again = scrape(second.metrics.exposition())
    assert value(again, "openrl_metrics_redeliveries_total") == len(stream.events)
    del again[("openrl_metrics_redeliveries_total", frozenset())]
    del exact[("openrl_metrics_redeliveries_total", frozenset())]
    assert again == exact
    second.close()

    # A clean restart resumes from the committed offsets: new events only, counted once.
    stream.completed(stream.events[6], 7)  # req-fb-3 finishes
    third = service(log, codec, path)
    drain(third)
    after = scrape(third.metrics.exposition())
    assert value(after, "openrl_metrics_redeliveries_total") == len(stream.events) - 1  # from before, kept
    assert value(after, "openrl_requests_completed_total", **req("forward_backward")) == 2
    assert value(after, "openrl_queue_depth", **req("forward_backward")) == 0
    assert value(after, "openrl_training_tokens_total", tenant="alice", base_model=BASE) == 16
    third.close()


def test_a_crash_before_any_save_rebuilds_from_the_beginning(rig, tmp_path):
    log, codec, publisher = rig
    timed(Stream("alice", publisher))
    path = tmp_path / "state.json"
    first = service(log, codec, path)
    drain(first)
    expected = scrape(first.metrics.exposition())
    first.consumer.close()  # dies: nothing saved, nothing committed
    assert not path.exists()
    second = service(log, codec, path)
    assert second.group != first.group  # a new state, a new group, the whole log again
    drain(second)
    assert scrape(second.metrics.exposition()) == expected
    second.close()


def test_the_http_function_counts_like_the_log_consumer(rig, tmp_path):
    log, codec, publisher = rig
    stream = Stream("alice", publisher)
    timed(stream)
    svc = service(log, codec, tmp_path / "reference.json")
    drain(svc)
    by_log = scrape(svc.metrics.exposition())
    svc.close()

    function = new()
    function.start({"DATA_DIR": str(tmp_path / "knative")})

    async def deliver():
        transport = httpx.ASGITransport(app=function.handle)
        async with httpx.AsyncClient(transport=transport, base_url="http://metrics") as client:
            applied = []
            for event in stream.events + stream.events[:3]:
                headers, body = codec.encode_http(event)
                applied.append((await client.post("/", headers=headers, content=body)).json()["applied"])
            page = await client.get("/metrics")
            missing = await client.get("/other")
            return applied, page, missing.status_code

    applied, page, missing = asyncio.run(deliver())
    assert applied == [True] * len(stream.events) + [False] * 3
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    by_http = scrape(page.text)
    assert value(by_http, "openrl_metrics_redeliveries_total") == 3
    for samples in (by_http, by_log):
        del samples[("openrl_metrics_redeliveries_total", frozenset())]
        # tokens per second depend on the wall clock at scrape time: compared above, not here
        for key in [k for k in samples if k[0].endswith("_per_second")]:
            del samples[key]
    assert by_http == by_log
    assert missing == 404
    function.stop()  # saves: a restarted function carries on from the same numbers
    restarted = new()
    restarted.start({"DATA_DIR": str(tmp_path / "knative")})
    assert restarted.metrics.state.to_json() == function.metrics.state.to_json()


def test_metrics_are_served_over_http(rig, tmp_path):
    log, codec, publisher = rig
    timed(Stream("alice", publisher))
    svc = service(log, codec, tmp_path / "state.json")
    port = svc.serve_http()
    drain(svc)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        served = scrape(answer.read())
    assert value(served, "openrl_requests_total", **req("forward_backward")) == 3
    svc.close()


def test_metrics_bind_to_metrics_host_not_the_gateways_host(rig, tmp_path):
    """/metrics needs no key: it listens where `metrics_host` says (loopback by default), even
    when the gateway's `host` is every address."""
    log, codec, _ = rig
    assert Settings(data_dir=tmp_path, host="0.0.0.0").metrics_host == "127.0.0.1"
    settings = Settings(data_dir=tmp_path, host="0.0.0.0", metrics_host="127.0.0.2", metrics_port=0)
    svc = MetricsService.from_settings(log, codec, settings)
    port = svc.serve_http()
    try:
        assert svc._server.server_address[:2] == ("127.0.0.2", port)
        with urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=5) as answer:
            assert answer.status == 200 and b"openrl_" in answer.read()
        with pytest.raises(OSError):  # nothing on the gateway's addresses (127.0.0.1 is one of 0.0.0.0's)
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        svc.close()


def test_tenants_are_counted_apart(rig, tmp_path):
    log, codec, publisher = rig
    timed(Stream("alice", publisher))
    bob = Stream("bob", publisher, session="s9")
    bob.completed(bob.create_model("req-b", 0), 1)
    svc = service(log, codec, tmp_path / "state.json")
    drain(svc)
    m = scrape(svc.metrics.exposition())
    assert value(m, "openrl_requests_total", **req("create_model", "bob")) == 1
    assert value(m, "openrl_requests_total", **req("forward_backward", "alice")) == 3
    assert ("openrl_requests_total", frozenset(req("forward_backward", "bob").items())) not in m
    latency = {"base_model": BASE, "type": "create_model", "outcome": "completed"}
    assert value(m, "openrl_request_latency_seconds_count", **latency) == 2
    assert value(m, "openrl_request_latency_seconds_sum", **latency) == 1.25
    svc.close()


def test_a_finish_whose_request_never_comes_is_settled_once_caught_up(rig, tmp_path):
    log, codec, publisher = rig
    stream = Stream("alice", publisher)
    stream.create_model("req-0", 0)
    lost = Stream("alice").forward_backward("req-lost", 1)  # built, not published: as if the log had lost it
    svc = service(log, codec, tmp_path / "state.json")
    from openrl_core.events import training as te
    from openrl_core.events.lifecycle import RequestCompleted

    stream.emit(te.FORWARD_BACKWARD["completed"], RequestCompleted(request_id="req-lost", result={}), t=2,
                source="/openrl/trainer", key=stream.model, stream="completions")  # fmt: skip
    svc.run_once(timeout=0.05)  # reads both topics
    assert svc.metrics.state.early  # waiting: its request might still be in an unread partition
    drain(svc)  # the empty poll settles it: labelled from its key, not timed
    m = scrape(svc.metrics.exposition())
    assert value(m, "openrl_requests_completed_total", **req("forward_backward")) == 1
    assert (
        "openrl_request_latency_seconds_count",
        frozenset({"base_model": BASE, "type": "forward_backward", "outcome": "completed"}.items()),
    ) not in m
    # Should the request turn up after all (a late partition), it counts but never queues.
    publisher.publish("openrl.alice.training.late", lost)
    drain(svc)
    m = scrape(svc.metrics.exposition())
    assert value(m, "openrl_requests_total", **req("forward_backward")) == 1
    assert value(m, "openrl_queue_depth", **req("forward_backward")) == 0
    svc.close()
