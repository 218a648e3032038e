"""OpenTelemetry traces of each request's path, received by a real OTLP/HTTP receiver.

A real `openrl serve` with `OPENRL_OTEL_ENDPOINT` pointing at a receiver in this test
(http.server on loopback, decoding each POST /v1/traces as the protobuf
ExportTraceServiceRequest), one forward_backward and one optim_step through the real tinker
SDK on the tiny model: every one of the run's requests arrives as one trace whose ids are
derived from its request id, a root `<verb>` span with the children `gateway→log (queued)`,
`worker (run)` and `projector (store)`, each starting and ending at the stored events' own
times, with the tenant, model id, request id, worker and lease as attributes. With the
setting unset (and OpenTelemetry's own OTEL_EXPORTER_OTLP_* variables pointing at the
receiver) nothing arrives and OpenTelemetry's SDK is never imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import tinker
from sqlalchemy import create_engine, select
from tinker import types

from eventing.blobs import BlobStore
from eventing.codec import Codec
from eventing.store import tables as t
from eventing.store.event_store import EventStore
from eventing.store.projections import utc
from functions.local_server import REPO, LocalServer
from openrl_core import request_spans
from tests.e2e.sdk_close import close_service
from tests.functions.otlp_receiver import Receiver, attributes

pytestmark = pytest.mark.e2e

MODEL = "openrl/tiny-qwen3"
KEY = "tml-otel-alice"


@pytest.fixture
def receiver():
    found = Receiver()
    yield found
    found.close()


def train_one_step(url: str, sample: bool = False) -> str:
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    tokens = training.get_tokenizer().encode("Two plus three is five. Two plus three is five.")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    if sample:
        sampler = training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=1)
        sampler.sample(types.ModelInput.from_ints(tokens[:5]), 1, params).result()
    close_service(service)
    return training.model_id


def stored_requests(data_dir: Path) -> dict[str, dict]:
    """Per request of alice's, read straight from the server's event store: its verb and key,
    the times of its events, and who finished it under which lease."""
    engine = create_engine(f"sqlite:///{data_dir / 'events.db'}")
    store = EventStore(engine, Codec(BlobStore(data_dir / "blobs")))
    out: dict[str, dict] = {}
    with engine.connect() as conn:
        for row in conn.execute(select(t.events).where(t.events.c.tenant == "alice").order_by(t.events.c.position)):
            _, _, family, verb, phase, _ = row.type.split(".")
            if row.subject is None or phase not in ("requested", "started", "completed"):
                continue
            entry = out.setdefault(row.subject, {"verb": verb, "family": family, "key": row.key})
            entry[phase] = utc(row.time)
            if phase == "completed":
                entry["worker"], entry["lease_id"] = row.source, row.lease_id
                details = getattr(store.event_of(row).data, "details", None) or {}
                if "started" in details and "started" not in entry:
                    entry["started"] = utc(datetime.fromisoformat(details["started"]))
    engine.dispose()
    return {request_id: entry for request_id, entry in out.items() if "requested" in entry}


def nanos(moment: datetime) -> int:
    return round(moment.timestamp() * 1_000_000) * 1000


def test_each_request_arrives_as_one_trace_with_the_stored_times(tmp_path, receiver):
    env = {"OPENRL_OTEL_ENDPOINT": receiver.url, "OPENRL_OTEL_SERVICE_NAME": "openrl-under-test"}
    with LocalServer(tmp_path, [MODEL], f"alice={KEY}", extra_env=env) as server:
        model_id = train_one_step(server.url, sample=True)
        requests = stored_requests(tmp_path)
        verbs = sorted(entry["verb"] for entry in requests.values())
        assert {"create_model", "forward_backward", "optim_step", "sample"} <= set(verbs), verbs
        assert {entry["key"] for entry in requests.values() if entry["family"] == "training"} == {model_id}
        trace_ids = {request_spans.trace_id_of(request_id).to_bytes(16, "big") for request_id in requests}
        # Every request's root and store spans, posted by the batch exporter within about a second.
        assert receiver.wait_for(lambda: sum(s.trace_id in trace_ids for _, s in receiver.spans) >= 3 * len(trace_ids))
        time.sleep(1.5)  # and whatever else it was going to post

    for request_id, entry in requests.items():
        trace_id = request_spans.trace_id_of(request_id).to_bytes(16, "big")
        spans = [span for _, span in receiver.spans if span.trace_id == trace_id]
        roots = [span for span in spans if not span.parent_span_id]
        assert len(roots) == 1, (request_id, spans)
        root = roots[0]
        assert root.name == entry["verb"]
        children = {span.name: span for span in spans if span.parent_span_id == root.span_id}
        assert len(spans) == 1 + len(children), "every span is the root or its child"
        store = children["projector (store)"]
        # The stored events' own times, to the microsecond the store keeps.
        assert root.start_time_unix_nano == nanos(entry["requested"])
        if "started" in entry:  # the trainer records when it began
            assert set(children) == {"gateway→log (queued)", "worker (run)", "projector (store)"}, (entry, children)
            queued, run = children["gateway→log (queued)"], children["worker (run)"]
            assert queued.start_time_unix_nano == nanos(entry["requested"])
            assert queued.end_time_unix_nano == run.start_time_unix_nano == nanos(entry["started"])
        else:  # the sampler does not
            assert set(children) == {"worker (queued and run)", "projector (store)"}, (entry, children)
            run = children["worker (queued and run)"]
            assert run.start_time_unix_nano == nanos(entry["requested"])
        assert run.end_time_unix_nano == store.start_time_unix_nano == nanos(entry["completed"])
        assert store.end_time_unix_nano >= store.start_time_unix_nano
        assert root.end_time_unix_nano == store.end_time_unix_nano
        for span in (root, *children.values()):
            found = attributes(span)
            assert found["openrl.request_id"] == request_id
            assert found["openrl.tenant"] == "alice"
            assert found["openrl.model_id"] == entry["key"]
            assert found["openrl.worker"] == entry["worker"]
            assert found["openrl.outcome"] == "completed"
            if entry["lease_id"] is not None:
                assert found["openrl.lease_id"] == entry["lease_id"]
        assert root.span_id == request_spans.span_id_of(request_id, entry["verb"]).to_bytes(8, "big")
    assert {resource["service.name"] for resource, _ in receiver.spans} == {"openrl-under-test"}


IMPORTS = """
import sys
from functions.serve import Node
from openrl_core.settings import Settings
node = Node(Settings(data_dir=sys.argv[1]), ("projector",))
print(sorted({m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter", "functions.request_traces"))}))
node.runtime.close()
"""


def projector_imports(tmp_path: Path, env: dict) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OPENRL_OTEL")}
    done = subprocess.run([sys.executable, "-c", IMPORTS, str(tmp_path)], cwd=REPO, env={**clean, **env},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_unset_exports_nothing_and_imports_no_sdk(tmp_path, receiver):
    otel_env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url + "/v1/traces",
    }
    assert projector_imports(tmp_path / "off", otel_env) == "[]"
    # The check can fail: with the setting, the projector's process loads the SDK and the exporter.
    on = projector_imports(tmp_path / "on", {"OPENRL_OTEL_ENDPOINT": receiver.url})
    assert "functions.request_traces" in on and "opentelemetry.sdk.trace" in on, on

    with LocalServer(tmp_path / "serve", [MODEL], f"alice={KEY}", extra_env=otel_env) as server:
        model_id = train_one_step(server.url)
        assert model_id and stored_requests(tmp_path / "serve"), "the requests were served and stored"
        time.sleep(2.5)  # past the batch exporter's 1 s delay, had one been started
    assert receiver.posts == 0 and receiver.spans == []
