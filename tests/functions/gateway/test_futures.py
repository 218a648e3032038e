"""retrieve_future long-polls: held until the deadline (then try_again), woken at once by a
completion, results retrievable again and again, failures as {error, category}."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from eventing import topics
from eventing.projector import Projector
from functions.gateway.app import create_app
from functions.runtime import Runtime
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.events.lifecycle import RequestCompleted, RequestFailed
from openrl_core.settings import Settings

KEY = "tml-futures"
MODEL = "openrl/tiny-qwen3"


@pytest.fixture
def rig(tmp_path, tiny_files):
    runtime = Runtime(Settings(data_dir=tmp_path, models=[MODEL], api_keys=[f"alice={KEY}"], long_poll_seconds=1.5))
    stop = threading.Event()
    projector = Projector(runtime.bus, runtime.store, runtime.notifier)
    thread = threading.Thread(target=projector.run, args=(stop,), daemon=True)
    thread.start()
    with TestClient(create_app(runtime.gateway_context())) as client:
        client.headers["X-API-Key"] = KEY
        session = client.post("/api/v1/create_session", json={}).json()["session_id"]
        model = client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": MODEL,
                                                          "lora_config": {"rank": 4}}).json()  # fmt: skip
        future = client.post("/api/v1/optim_step", json={"model_id": model["model_id"], "seq_id": 1}).json()
        yield client, runtime, future["request_id"]
    stop.set()
    thread.join()
    runtime.close()


def complete(runtime, request_id, payload):
    phase = "completed" if isinstance(payload, RequestCompleted) else "failed"
    event = new_event(te.OPTIM_STEP[phase], payload, tenant="alice", source="/test-worker", key="m", subject=request_id)
    runtime.publisher.publish(topics.topic("alice", "completions"), event)


def test_an_unfinished_future_is_held_then_answered_try_again(rig):
    client, _, request_id = rig
    started = time.monotonic()
    answer = client.post("/api/v1/retrieve_future", json={"request_id": request_id, "allow_metadata_only": True})
    waited = time.monotonic() - started
    assert answer.status_code == 408  # the SDK re-polls a 408 at once, without a warning per poll
    assert answer.json() == {"type": "try_again", "request_id": request_id, "queue_state": "active"}
    assert 1.4 <= waited < 5  # held for the long-poll window, not answered at once


def test_a_completion_wakes_the_waiter_long_before_the_deadline(rig):
    client, runtime, request_id = rig
    runtime.settings.long_poll_seconds = 20
    timer = threading.Timer(
        0.3,
        complete,
        (runtime, request_id, RequestCompleted(request_id=request_id, result={"metrics": {"optim/lr": 1e-4}})),
    )
    started = time.monotonic()
    timer.start()
    answer = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
    waited = time.monotonic() - started
    assert answer.json() == {"metrics": {"optim/lr": 1e-4}}
    assert 0.3 <= waited < 2.0
    # retrievable again (a lost response is asked for again), and at once
    started = time.monotonic()
    assert client.post("/api/v1/retrieve_future", json={"request_id": request_id}).json() == {
        "metrics": {"optim/lr": 1e-4}
    }
    assert time.monotonic() - started < 1.0


def test_a_failure_is_reported_with_its_category_and_a_late_success_does_not_override_it(rig):
    client, runtime, request_id = rig
    complete(runtime, request_id, RequestFailed(request_id=request_id, error="out of memory", category="server"))
    deadline = time.monotonic() + 5
    answer = client.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
    while "error" not in answer and time.monotonic() < deadline:
        answer = client.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
    assert answer == {"error": "out of memory", "category": "server"}
    complete(runtime, request_id, RequestCompleted(request_id=request_id, result={"metrics": {}}))
    time.sleep(0.5)
    assert client.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()["error"] == "out of memory"


def test_a_completion_that_lands_while_the_store_is_read_still_wakes_the_waiter(rig):
    """Regression: the wake-up used to be cleared after the read, losing this completion."""
    client, runtime, request_id = rig
    runtime.settings.long_poll_seconds = 20
    ctx = client.app.state.ctx
    read = ctx.projections.future
    calls = []

    def racing_read(tenant, rid):
        row = read(tenant, rid)  # still pending
        if not calls:
            calls.append(rid)
            woke = threading.Event()
            ctx.waiters.notify, original = (lambda ids: (original(ids), woke.set())), ctx.waiters.notify
            complete(runtime, rid, RequestCompleted(request_id=rid, result={"metrics": {}}))
            assert woke.wait(5)  # the projector has stored it and notified, mid-read
            ctx.waiters.notify = original
        return row

    ctx.projections.future = racing_read
    runtime.notifier._listeners = [lambda ids: ctx.waiters.notify(ids)]
    started = time.monotonic()
    answer = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
    assert answer.json() == {"metrics": {}}
    assert time.monotonic() - started < 5
