"""The fast lane answers exactly as FastAPI does: the same requests, sent through the lane and
through FastAPI's own stack on the same app, get byte-identical answers (status, the headers a
client reads, body), store the same events, and record the same refusals.

Most of the suite already goes through the lane (every test that posts a hot route); this
file pins the equivalence itself, including the paths a mistake would hide in: errors,
audit records, the body limit, duplicate submissions and a held long-poll."""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from eventing import topics
from eventing.projector import Projector
from eventing.store import tables
from functions.gateway import fast_lane
from functions.gateway.app import create_app
from functions.gateway.fast_lane import lane_routes
from functions.runtime import Runtime
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.events.lifecycle import RequestCompleted, RequestFailed
from openrl_core.settings import Settings
from tests.functions.gateway.test_bad_input import fb_body

ALICE, BOB = "tml-lane-alice", "tml-lane-bob"
MODEL = "openrl/tiny-qwen3"
HOT = {
    "/api/v1/forward_backward",
    "/api/v1/forward",
    "/api/v1/optim_step",
    "/api/v1/asample",
    "/api/v1/retrieve_future",
}
VARYING = {"date", "server"}  # set by the HTTP server per response, not by either path


@pytest.fixture
def rig(tmp_path, tiny_files):
    """One app; `lane` is the client through it as served, `framework` through FastAPI's own
    stack (the lane bypassed), both over the same store and log."""
    settings = Settings(
        data_dir=tmp_path, models=[MODEL], api_keys=[f"alice={ALICE}", f"bob={BOB}"], long_poll_seconds=0.3,
        metadata_only_threshold_bytes=1024, max_request_bytes=64 * 1024,
    )  # fmt: skip
    runtime = Runtime(settings)
    stop = threading.Event()
    projector = Projector(runtime.bus, runtime.store, runtime.notifier)
    thread = threading.Thread(target=projector.run, args=(stop,), daemon=True)
    thread.start()
    app = create_app(runtime.gateway_context())

    async def through_fastapi(scope, receive, send):
        await FastAPI.__call__(app, scope, receive, send)

    with TestClient(app) as lane, TestClient(through_fastapi) as framework:
        yield lane, framework, runtime, app
    stop.set()
    thread.join()
    runtime.close()


def post(client, path, body, key=ALICE, headers=None):
    sent = {"X-API-Key": key} if key else {}
    sent.update(headers or {})
    if isinstance(body, (bytes, bytearray)):
        return client.post(path, content=body, headers=sent)
    return client.post(path, json=body, headers=sent)


def same(lane_answer, framework_answer):
    assert lane_answer.status_code == framework_answer.status_code, (lane_answer.text, framework_answer.text)
    headers = [
        sorted((k, v) for k, v in answer.headers.multi_items() if k not in VARYING)
        for answer in (lane_answer, framework_answer)
    ]
    assert headers[0] == headers[1]
    assert lane_answer.content == framework_answer.content


def count(runtime, type_fragment):
    with runtime.engine.connect() as conn:
        return conn.execute(select(func.count()).where(tables.events.c.type.contains(type_fragment))).scalar()


def model_of(client, key=ALICE):
    session = post(client, "/api/v1/create_session", {}, key).json()["session_id"]
    created = post(client, "/api/v1/create_model", {"session_id": session, "model_seq_id": 0, "base_model": MODEL,
                                                     "lora_config": {"rank": 4}}, key).json()  # fmt: skip
    return created["model_id"]


def test_the_lane_takes_the_hot_routes_and_only_plain_ones(rig):
    _, _, _, app = rig
    taken = set(lane_routes(app))
    assert HOT <= taken
    # Routes with path parameters or other dependencies stay with FastAPI.
    assert not any("{" in path for path in taken)
    assert "/api/v1/create_session" not in taken  # solved by FastAPI (a body model it validates)
    assert all(path.startswith("/api/v1/") for path in taken)


@pytest.mark.parametrize("path", sorted(HOT))
def test_refusals_are_the_same_bytes_and_store_nothing_more(rig, path):
    lane, framework, runtime, _ = rig
    cases = [
        ({}, None),  # no key
        ({}, "tml-not-a-key"),  # unknown key
        (b"{not json", ALICE),  # malformed body
        ({"model_id": "nope", "seq_id": 1, "request_id": "nope"}, ALICE),  # unknown ids: 404, or a 400 for bad shapes
        ({"model_id": 7, "seq_id": "x", "request_id": 3}, ALICE),  # wrong types
    ]
    for (body, key), content_type in itertools.product(cases, ("application/json", "text/plain")):
        before = count(runtime, "")
        first = post(lane, path, body, key, {"Content-Type": content_type})
        middle = count(runtime, "")
        second = post(framework, path, body, key, {"Content-Type": content_type})
        assert 400 <= first.status_code < 500, first.text
        same(first, second)
        # Each refusal stores the same thing either way: nothing, or one audit record of a 404.
        assert middle - before == count(runtime, "") - middle
        assert middle - before == (1 if first.status_code == 404 and key == ALICE else 0)


def test_the_body_limit_holds_on_the_lane(rig):
    lane, framework, _, _ = rig
    model_id = model_of(lane)
    big = json.dumps({"model_id": model_id, "seq_id": 1, "pad": "x" * 70_000}).encode()
    same(post(lane, "/api/v1/optim_step", big), post(framework, "/api/v1/optim_step", big))
    assert post(lane, "/api/v1/optim_step", big).status_code == 413

    def chunks():  # no Content-Length: counted as it streams
        yield big[:40_000]
        yield big[40_000:]

    headers = {"X-API-Key": ALICE, "Content-Type": "application/json"}
    streamed = [client.post("/api/v1/optim_step", content=chunks(), headers=headers) for client in (lane, framework)]
    assert streamed[0].status_code == 413
    same(*streamed)


def test_submissions_and_their_duplicates_answer_alike(rig):
    lane, framework, runtime, _ = rig
    model_id = model_of(lane)
    step = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-4}}
    first = post(lane, "/api/v1/optim_step", step)
    assert first.status_code == 200 and first.json()["request_id"]
    # The same seq_id again is the same request, deduplicated: the same future either way.
    same(post(lane, "/api/v1/optim_step", step), post(framework, "/api/v1/optim_step", step))
    assert post(framework, "/api/v1/optim_step", step).content == first.content
    assert count(runtime, "optim_step.requested") == 1
    # A protobuf forward_backward, then its duplicate through the other path.
    fb = fb_body(model_id, seq_id=2)
    proto = {"Content-Type": "application/x-protobuf"}
    submitted = post(lane, "/api/v1/forward_backward", fb, headers=proto)
    assert submitted.status_code == 200
    same(submitted, post(framework, "/api/v1/forward_backward", fb, headers=proto))
    assert count(runtime, "forward_backward.requested") == 1
    # Another tenant's model is unknown on both paths, and the audit sees both probes.
    probe = {"model_id": model_id, "seq_id": 3}
    refused = [post(client, "/api/v1/optim_step", probe, BOB) for client in (lane, framework)]
    assert refused[0].status_code == 404
    same(*refused)
    assert count(runtime, "lookup.refused") == 2
    with runtime.engine.connect() as conn:
        records = (
            conn.execute(select(tables.events.c.data).where(tables.events.c.type.contains("lookup.refused")))
            .scalars()
            .all()
        )
    assert records[0] == records[1] and "/api/v1/optim_step" in str(records[0])


def test_a_held_long_poll_ends_alike(rig):
    lane, framework, _, _ = rig
    model_id = model_of(lane)
    request_id = post(lane, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 1}).json()["request_id"]
    poll = {"request_id": request_id, "allow_metadata_only": True}
    answers = [post(client, "/api/v1/retrieve_future", poll) for client in (lane, framework)]
    assert answers[0].status_code == 408  # no worker here: held, then try_again
    same(*answers)


def test_other_methods_and_routes_still_go_through_fastapi(rig):
    lane, framework, _, _ = rig
    for method, path in (("GET", "/api/v1/optim_step"), ("POST", "/api/v1/create_session"), ("GET", "/api/v1/healthz")):
        answers = [client.request(method, path, headers={"X-API-Key": ALICE}, json={}) for client in (lane, framework)]
        assert answers[0].status_code == answers[1].status_code
        assert answers[0].headers.get("allow") == answers[1].headers.get("allow")
    assert lane.get("/api/v1/optim_step").headers["allow"] == "POST"  # the 405 names what is allowed


def test_finished_futures_answer_alike(rig):
    """A result (JSON, and protobuf where the SDK asks for it), its metadata-only answer, and a
    failure: each the same bytes through both paths."""
    lane, framework, runtime, _ = rig
    model_id = model_of(lane)
    done, failed = (
        post(lane, "/api/v1/optim_step", {"model_id": model_id, "seq_id": seq}).json()["request_id"] for seq in (1, 2)
    )
    big = {"metrics": {f"m{i}": float(i) for i in range(400)}}  # over the metadata-only threshold
    for request_id, payload in ((done, RequestCompleted(request_id=done, result=big)),
                                (failed, RequestFailed(request_id=failed, error="out of memory", category="server"))):  # fmt: skip
        phase = "completed" if isinstance(payload, RequestCompleted) else "failed"
        event = new_event(
            te.OPTIM_STEP[phase], payload, tenant="alice", source="/test-worker", key=model_id, subject=request_id
        )
        runtime.publisher.publish(topics.topic("alice", "completions"), event)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(
        runtime.store.finished.get("alice", request_id) is not None for request_id in (done, failed)
    ):
        time.sleep(0.05)
    for poll, accept in itertools.product(
        ({"request_id": done}, {"request_id": done, "allow_metadata_only": True}, {"request_id": failed}),
        ("application/json", "application/x-protobuf, application/json"),
    ):
        answers = [
            post(client, "/api/v1/retrieve_future", poll, headers={"Accept": accept}) for client in (lane, framework)
        ]
        assert answers[0].status_code == 200
        same(*answers)
    metadata = post(lane, "/api/v1/retrieve_future", {"request_id": done, "allow_metadata_only": True}).json()
    assert metadata["status"] == "complete_metadata"  # the case is the one it means to be


def test_with_opentelemetry_on_every_request_goes_through_fastapi(rig, monkeypatch):
    """FastAPI's spans and metrics are the lane's to keep: while its instrumentation is on,
    the lane steps aside (a trace without its hottest routes would mislead)."""
    lane, _, _, app = rig
    served = []
    original = app._limited.app  # what the lane's body limit hands a request to

    async def spy(scope, receive, send):
        served.append(scope["path"])
        await original(scope, receive, send)

    monkeypatch.setattr(app._limited, "app", spy)
    model_id = model_of(lane)
    assert post(lane, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 1}).status_code == 200
    assert served == ["/api/v1/create_model", "/api/v1/optim_step"]  # the lane, while telemetry is off
    monkeypatch.setattr(app._native_telemetry, "enabled", lambda: True)
    # The lane looks at FastAPI's check once a second (a provider is installed at start-up):
    # one installed while serving is seen within that second.
    time.sleep(fast_lane.TELEMETRY_RECHECK_SECONDS + 0.05)
    assert post(lane, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 2}).status_code == 200
    assert served == ["/api/v1/create_model", "/api/v1/optim_step"]


def test_the_telemetry_check_is_made_once_a_second_not_per_request(rig, monkeypatch):
    """FastAPI's check reads three providers and the environment (about 3 us): the lane
    asks it once per TELEMETRY_RECHECK_SECONDS, not on every hot request."""
    lane, _, _, app = rig
    model_id = model_of(lane)
    asked = []
    monkeypatch.setattr(app._native_telemetry, "enabled", lambda: asked.append(1) or False)
    monkeypatch.setattr(app, "_telemetry_until", float("-inf"))
    for seq_id in (1, 2, 3):
        assert post(lane, "/api/v1/optim_step", {"model_id": model_id, "seq_id": seq_id}).status_code == 200
    assert len(asked) == 1
