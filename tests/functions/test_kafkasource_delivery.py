"""The consumer functions served by the real Knative Functions Python runtime (func-python, in a
subprocess: `openrl function NAME`), fed over HTTP exactly as a KafkaSource delivers: binary
mode `ce-*` headers, the `knativekafkapartition`/`knativekafkaoffset` extensions, and the same
event delivered twice (delivery is at least once). Every delivery is answered 2xx and stored once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from eventing.blobs import BlobStore
from eventing.codec import Codec
from eventing.store import database
from eventing.store.event_store import EventStore
from eventing.store.queries import Projections
from functions.audit import read_entries
from tests.functions.audit.scenario import Stream

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Served:
    def __init__(self, name: str, tmp_path: Path, **env) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        environment = {**os.environ, "LISTEN_ADDRESS": f"127.0.0.1:{port}", "OPENRL_DATA_DIR": str(tmp_path),
                       "PYTHONPATH": str(ROOT), **env}  # fmt: skip
        self.log = open(tmp_path / f"{name}.log", "wb")
        self.process = subprocess.Popen([sys.executable, "-m", "functions.cli", "function", name], cwd=ROOT, env=environment,
                                        stdout=self.log, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health/readiness", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(
                    f"openrl function {name} did not become ready:\n" + (tmp_path / f"{name}.log").read_text()
                )
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(20)
        self.log.close()


def kafka_source_deliveries(codec: Codec, events, redeliver: int = 2):
    """(headers, body) per POST: each event once in partition order, then the first ones again."""
    deliveries = []
    for offset, event in enumerate(events):
        headers, body = codec.encode_http(event)
        headers.update({"ce-knativekafkapartition": "0", "ce-knativekafkaoffset": str(offset)})
        deliveries.append((headers, body))
    return deliveries + deliveries[:redeliver]


def realistic(stream: Stream):
    stream.session_created(t=0)
    create = stream.create_model("req-create", t=1)
    stream.completed(create, 2, {"model_id": stream.model})
    fb = stream.forward_backward("req-fb", t=3)
    stream.completed(fb, 4, {"loss_fn_outputs": [], "metrics": {"loss:sum": 1.5}})
    return stream.events


@pytest.fixture
def codec(tmp_path):
    return Codec(BlobStore(tmp_path / "blobs"))


def post_all(url: str, deliveries) -> list[httpx.Response]:
    return [httpx.post(url + "/", headers=headers, content=body, timeout=30) for headers, body in deliveries]


def test_audit_function(tmp_path, codec):
    events = realistic(Stream("alice"))
    served = Served("audit", tmp_path)
    try:
        answers = post_all(served.url, kafka_source_deliveries(codec, events))
        assert httpx.get(served.url + "/health/liveness").status_code == 200
        bad = httpx.post(served.url + "/", headers={"content-type": "application/json"}, content=b"{}")
    finally:
        served.stop()
    assert [a.status_code for a in answers] == [200] * (len(events) + 2)
    assert [a.json()["written"] for a in answers] == [1] * len(events) + [0, 0]
    assert [e["id"] for e in read_entries(tmp_path / "audit", "alice")] == [e.id for e in events]
    assert bad.status_code == 400  # never decodable: the source dead-letters it instead of retrying


def test_metrics_function(tmp_path, codec):
    events = realistic(Stream("alice"))
    served = Served("metrics", tmp_path, OPENRL_METRICS_CHECKPOINT_SECONDS="3600")
    try:
        answers = post_all(served.url, kafka_source_deliveries(codec, events))
        page = httpx.get(served.url + "/metrics").text
    finally:
        served.stop()
    assert [a.status_code for a in answers] == [200] * (len(events) + 2)
    assert [a.json()["applied"] for a in answers] == [True] * len(events) + [False, False]
    assert "openrl_metrics_redeliveries_total 2.0" in page
    assert 'openrl_requests_total{base_model="openrl/tiny-qwen3",tenant="alice",type="forward_backward"} 1.0' in page


def test_projector_function(tmp_path, codec):
    events = realistic(Stream("alice"))
    url = f"sqlite:///{tmp_path / 'events.db'}"
    served = Served("projector", tmp_path, OPENRL_DATABASE_URL=url)
    try:
        answers = post_all(served.url, kafka_source_deliveries(codec, events))
    finally:
        served.stop()
    assert [a.status_code for a in answers] == [200] * (len(events) + 2)
    assert [a.json()["stored"] for a in answers] == [True] * len(events) + [False, False]
    engine = database.make_engine(url)
    stored = [event.id for _, event in EventStore(engine, codec).read()]
    assert stored == [e.id for e in events]  # each once, in delivery order
    assert Projections(engine).future("alice", "req-fb").state == "completed"
    engine.dispose()


def test_dead_letter_function_keeps_what_it_is_sent(tmp_path):
    served = Served("dead-letters", tmp_path)
    headers = {"ce-id": "x1", "ce-type": "t", "ce-source": "s", "ce-specversion": "1.0", "kn-error-code": "500"}
    try:
        first = httpx.post(served.url + "/", headers=headers, content=b"payload")
        again = httpx.post(served.url + "/", headers=headers, content=b"payload")
    finally:
        served.stop()
    assert first.status_code == again.status_code == 200 and first.json() == again.json()
    [kept] = list((tmp_path / "dead-letters").iterdir())
    record = json.loads(kept.read_text())
    assert record["headers"]["kn-error-code"] == "500" and record["body_base64"] == "cGF5bG9hZA=="
