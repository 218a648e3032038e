"""A gateway beside its projector keeps the runs it looked up (eventing/store/known_runs.py):
a training request after the first reads no run from the store, and a cancel through the
API is refused (410) on the very next request, as without the kept rows."""

from __future__ import annotations

import threading
from contextlib import ExitStack

import pytest
from fastapi.testclient import TestClient

from eventing.projector import Projector
from eventing.store.queries import Projections
from functions.gateway.app import create_app
from functions.runtime import Runtime
from openrl_core.settings import Settings
from tests.functions.gateway.test_pending_hint import KEYS, MODEL


@pytest.fixture
def served(tmp_path, tiny_files, monkeypatch):
    """(client, run reads so far): a gateway and a projector over one runtime that follows runs."""
    reads = []
    run = Projections.run

    def counted(self, tenant, model_id):
        reads.append(model_id)
        return run(self, tenant, model_id)

    monkeypatch.setattr(Projections, "run", counted)
    with ExitStack() as running:
        runtime = Runtime(Settings(data_dir=tmp_path, models=[MODEL], api_keys=[f"{t}={k}" for t, k in KEYS.items()]))
        running.callback(runtime.close)
        runtime.store.runs.follow()  # as `Node` does with the embedded log and a projector beside the gateway
        stop = threading.Event()
        thread = threading.Thread(
            target=Projector(runtime.bus, runtime.store, runtime.notifier).run, args=(stop,), daemon=True
        )
        thread.start()
        running.callback(thread.join)
        running.callback(stop.set)
        client = running.enter_context(TestClient(create_app(runtime.gateway_context())))
        client.headers["X-API-Key"] = KEYS["alice"]
        yield client, reads


def test_a_kept_run_is_not_read_again_and_a_cancel_refuses_the_next_request(served):
    client, reads = served
    session = client.post("/api/v1/create_session", json={}).json()["session_id"]
    model = client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": MODEL,
                                                      "lora_config": {"rank": 4}}).json()["model_id"]  # fmt: skip
    step = lambda seq: client.post("/api/v1/optim_step", json={"model_id": model, "seq_id": seq})  # noqa: E731
    assert step(1).status_code == 200
    reads.clear()
    assert step(2).status_code == 200 and step(3).status_code == 200
    assert reads == []  # both answered from the kept row
    client.headers["X-API-Key"] = KEYS["bob"]
    assert step(4).status_code == 404  # another tenant's run, kept or not
    client.headers["X-API-Key"] = KEYS["alice"]
    assert client.post(f"/api/openrl/v1/runs/{model}/cancel", json={}).status_code == 200
    refused = step(4)
    assert refused.status_code == 410 and "was cancelled" in refused.json()["detail"]
