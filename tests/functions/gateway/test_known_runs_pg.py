"""Kept runs on PostgreSQL, where another process may change a run (eventing/store/known_runs.py).

Every store there announces the runs its transaction changed, by a NOTIFY in that
transaction, and a gateway drops what it hears: a run cancelled by another process's store is
refused (410) by this gateway within moments, not after the kept row's age runs out
(KEPT_RUN_SECONDS is raised to a minute here to tell the two apart). A lost LISTEN connection
drops every kept run, and a change nobody announced is seen once the row's age runs out."""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest
from fastapi.testclient import TestClient

from eventing.store import database
from eventing.store.event_store import EventStore
from eventing.store.queries import Projections
from functions import runtime as runtime_module
from functions.gateway.app import create_app
from functions.runtime import Runtime
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.settings import Settings
from tests.functions.gateway.test_pending_hint import KEYS, MODEL
from tests.functions.gateway.test_pending_hint_pg import end_listen_connections

pytestmark = pytest.mark.postgres


@pytest.fixture
def gateway(tmp_path, tiny_files, pg_url, monkeypatch):
    """(client, runtime, model_id, run reads): a gateway on PostgreSQL, alice's model created
    and stepped once; `reads` lists the run lookups that went to the store from then on."""
    monkeypatch.setattr(runtime_module, "KEPT_RUN_SECONDS", 60.0)
    reads = []
    run = Projections.run
    monkeypatch.setattr(
        Projections, "run", lambda self, tenant, model_id: reads.append(model_id) or run(self, tenant, model_id)
    )
    with ExitStack() as running:
        settings = Settings(
            data_dir=tmp_path, database_url=pg_url, models=[MODEL], api_keys=[f"{t}={k}" for t, k in KEYS.items()]
        )
        runtime = Runtime(settings)
        running.callback(runtime.close)
        client = running.enter_context(TestClient(create_app(runtime.gateway_context())))
        client.headers["X-API-Key"] = KEYS["alice"]
        session = client.post("/api/v1/create_session", json={}).json()["session_id"]
        model = client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": MODEL,
                                                          "lora_config": {"rank": 4}}).json()["model_id"]  # fmt: skip
        assert step(client, model, 1).status_code == 200
        reads.clear()
        yield client, runtime, model, reads


def step(client, model: str, seq: int):
    return client.post("/api/v1/optim_step", json={"model_id": model, "seq_id": seq})


def cancel_in_another_process(runtime, model: str, announce: bool = True) -> None:
    """What another process's gateway does on a cancel: its own store, its own transaction."""
    engine = database.make_engine(runtime.engine.url.render_as_string(hide_password=False))
    try:
        store = EventStore(engine, runtime.codec)
        if announce:
            store.announce_runs()
        store.append(
            new_event(te.RUN_CANCELLED, te.RunCancelled(model_id=model), tenant="alice", source="/elsewhere", key=model)
        )
    finally:
        engine.dispose()


def refused_within(client, model: str, seconds: float) -> float:
    """Steps until one is refused as cancelled; the seconds that took."""
    started, seq = time.monotonic(), 100
    while True:
        answer = step(client, model, seq)
        if answer.status_code == 410:
            assert "was cancelled" in answer.json()["detail"]
            return time.monotonic() - started
        assert answer.status_code == 200 and time.monotonic() - started < seconds, answer.text
        seq += 1
        time.sleep(0.02)


def test_a_run_cancelled_by_another_process_is_refused_once_announced(gateway):
    client, runtime, model, reads = gateway
    assert step(client, model, 2).status_code == 200 and step(client, model, 3).status_code == 200
    assert reads == []  # kept: no store read per request
    cancel_in_another_process(runtime, model)
    assert refused_within(client, model, 10.0) < 5.0  # the announcement, not the kept row's age (60 s)


def test_a_lost_listen_connection_drops_every_kept_run(gateway, pg_url):
    _client, runtime, model, _reads = gateway
    assert runtime.store.runs.get("alice", model) is not None
    end_listen_connections(pg_url)
    deadline = time.monotonic() + 10
    while (
        runtime.store.runs.get("alice", model) is not None
    ):  # announcements meanwhile are lost: nothing kept is trusted
        assert time.monotonic() < deadline, "the kept run outlived the lost connection"
        time.sleep(0.05)


def test_a_change_nobody_announced_is_seen_once_the_kept_row_is_too_old(gateway):
    client, runtime, model, _reads = gateway
    runtime.store.runs.max_age = 1.0
    cancel_in_another_process(runtime, model, announce=False)
    assert step(client, model, 2).status_code == 200  # kept, and wrong for now
    assert refused_within(client, model, 10.0) < 3.0


def test_serve_with_the_embedded_log_on_postgresql_keeps_the_age_bound(tmp_path, tiny_files, pg_url):
    """`openrl serve` with the projector beside the gateway follows runs for its own reasons,
    but on PostgreSQL the gateway's bound on a kept row's age stays (another process may
    still write the database)."""
    from functions.serve import Node

    node = Node(Settings(data_dir=tmp_path, database_url=pg_url, models=[MODEL]), ("gateway", "projector"))
    try:
        assert node.runtime.store.runs.following and node.runtime.store.runs.max_age == runtime_module.KEPT_RUN_SECONDS
    finally:
        node.stop()
