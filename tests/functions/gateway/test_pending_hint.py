"""retrieve_future's first look at a future this process knows is running: no store read, the
same answers, and a hint that turns out wrong costs a short wait, never an answer.

`openrl serve` with the embedded log follows pending futures (`eventing/store/finished.py`):
the gateway appends every request and the projector beside it folds every completion through
one store object. On SQLite, the Kafka deployment and a gateway without a projector do not;
a gateway on PostgreSQL does, since it hears every projector's announcements
(test_pending_hint_pg.py)."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

import pytest
from fastapi.testclient import TestClient

from eventing import topics
from eventing.projector import Projector
from eventing.store import database
from eventing.store.event_store import EventStore
from functions.gateway.app import create_app
from functions.gateway.routes import futures as futures_route
from functions.runtime import Runtime
from functions.serve import Node
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.events.lifecycle import RequestCompleted
from openrl_core.settings import Settings
from tests.eventing.brokers import TansuBroker

KEYS = {"alice": "tml-hint-alice", "bob": "tml-hint-bob"}
MODEL = "openrl/tiny-qwen3"
RESULT = {"metrics": {"optim/lr": 1e-4}}


def submit_one_step(client) -> str:
    """A session, a LoRA model and one optim_step of it; the step's request id."""
    session = client.post("/api/v1/create_session", json={}).json()["session_id"]
    model = client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": MODEL,
                                                      "lora_config": {"rank": 4}}).json()  # fmt: skip
    return client.post("/api/v1/optim_step", json={"model_id": model["model_id"], "seq_id": 1}).json()["request_id"]


def retrieve_finished_meanwhile(client, request_id: str, finish, after: float = 0.3):
    """retrieve_future while `finish()` runs `after` seconds in; (the answer, seconds waited)."""
    timer = threading.Timer(after, finish)
    timer.start()
    started = time.monotonic()
    answer = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
    waited = time.monotonic() - started
    timer.join()
    return answer, waited


def count_store_reads(monkeypatch) -> list:
    """The request ids retrieve_future reads from the store, in order, from now on."""
    reads = []
    answer_if_finished = futures_route._answer_if_finished

    def counted(ctx, tenant, body, accept):
        reads.append(body.request_id)
        return answer_if_finished(ctx, tenant, body, accept)

    monkeypatch.setattr(futures_route, "_answer_if_finished", counted)
    return reads


@pytest.fixture
def served(tmp_path, tiny_files, monkeypatch):
    """(start(follow) -> (client, runtime, request_id), store reads so far): a gateway and a
    projector over one runtime, one optim_step of alice's submitted and running."""
    reads = count_store_reads(monkeypatch)
    running = ExitStack()

    def start(follow: bool):
        runtime = Runtime(
            Settings(
                data_dir=tmp_path, models=[MODEL], api_keys=[f"{t}={k}" for t, k in KEYS.items()], long_poll_seconds=20
            )
        )
        running.callback(runtime.close)
        if follow:  # before the submission below, as `Node` does before it serves
            runtime.store.finished.follow_pending()
        stop = threading.Event()
        projector = Projector(runtime.bus, runtime.store, runtime.notifier)
        thread = threading.Thread(target=projector.run, args=(stop,), daemon=True)
        thread.start()
        running.callback(thread.join)
        running.callback(stop.set)
        client = running.enter_context(TestClient(create_app(runtime.gateway_context())))
        client.headers["X-API-Key"] = KEYS["alice"]
        request_id = submit_one_step(client)
        reads.clear()
        return client, runtime, request_id

    with running:  # on the way out: the client, then the projector, then the runtime
        yield start, reads


def completed(request_id: str):
    done = RequestCompleted(request_id=request_id, result=RESULT)
    return new_event(
        te.OPTIM_STEP["completed"], done, tenant="alice", source="/test-worker", key="m", subject=request_id
    )


def finish_elsewhere(runtime, request_id: str) -> None:
    """Complete the future through another store object on the same database (as another
    process would): the gateway's memory does not see it, and nothing wakes its waiters."""
    engine = database.make_engine(str(runtime.engine.url))
    try:
        EventStore(engine, runtime.codec).append(completed(request_id))
    finally:
        engine.dispose()


@pytest.mark.parametrize("follow", [True, False], ids=["followed", "not-followed"])
def test_a_running_future_known_to_this_process_is_waited_on_without_a_store_read(served, follow):
    start, reads = served
    client, runtime, request_id = start(follow)
    assert runtime.store.finished.pending("alice", request_id) is follow
    # The worker's completion goes through the log and the projector, as in `openrl serve`.
    answer, waited = retrieve_finished_meanwhile(
        client,
        request_id,
        lambda: runtime.publisher.publish(topics.topic("alice", "completions"), completed(request_id)),
    )
    assert answer.status_code == 200 and answer.json() == RESULT
    assert 0.3 <= waited < 2.0  # woken by the completion, as without the hint
    # Followed: no look at the store at all (the woken wait is answered from memory).
    # Not followed: the first look reads the store and finds the future running.
    assert reads == ([] if follow else [request_id])
    assert not runtime.store.finished.pending("alice", request_id)


def test_a_wrong_hint_costs_a_short_wait_not_the_long_poll_window(served):
    """A future finished by a write this store object did not see (another process's, say),
    with no notification to wake the wait: the store is read PENDING_HINT_WAIT later."""
    start, reads = served
    client, runtime, request_id = start(True)
    finish_elsewhere(runtime, request_id)
    assert runtime.store.finished.pending("alice", request_id)  # this process's memory is now wrong
    started = time.monotonic()
    answer = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
    waited = time.monotonic() - started
    assert answer.status_code == 200 and answer.json() == RESULT
    assert futures_route.PENDING_HINT_WAIT - 0.05 <= waited < futures_route.PENDING_HINT_WAIT + 1.5  # not 20 s
    assert reads == [request_id]


def test_a_wrong_hint_never_answers_try_again_however_short_the_window(served):
    start, _reads = served
    client, runtime, request_id = start(True)
    runtime.settings.long_poll_seconds = 0  # past the deadline at the first look
    finish_elsewhere(runtime, request_id)
    answer = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
    assert answer.status_code == 200 and answer.json() == RESULT


def test_another_tenants_running_future_is_unknown_as_before(served):
    start, reads = served
    client, runtime, request_id = start(True)
    unknown = client.post("/api/v1/retrieve_future", json={"request_id": "req-no-such-future"})
    client.headers["X-API-Key"] = KEYS["bob"]
    theirs = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json()["detail"] == unknown.json()["detail"].replace("req-no-such-future", request_id)
    assert reads == ["req-no-such-future", request_id]  # both read the store: the hint is alice's alone


def test_openrl_serve_on_sqlite_follows_pending_futures_only_with_the_embedded_log_and_its_projector(
    tmp_path, tiny_files
):
    def follows(roles, **settings) -> bool:
        node = Node(Settings(data_dir=tmp_path / str(len(list(tmp_path.iterdir()))), models=[MODEL], **settings), roles)
        try:
            node.runtime.store.finished.put_many([{"request_id": "r", "tenant": "t", "state": "pending"}])
            return node.runtime.store.finished.pending("t", "r")
        finally:
            node.stop()

    assert follows(("gateway", "projector"))
    assert not follows(("gateway",))  # the projector is another process: completions land unseen
    assert not follows(("projector",))
    broker = TansuBroker(tmp_path / "tansu").start()
    try:
        assert not follows(("gateway", "projector"), bus="kafka", kafka_bootstrap=broker.bootstrap)
    finally:
        broker.stop()
