"""What only `openrl serve`/`openrl gateway` did must also happen with the gateway as a Knative function:
the checkpoint TTL reaper runs, and with several gateway replicas a sample submitted through one
wakes a retrieve_futures held on another (PostgreSQL LISTEN/NOTIFY), not only at the window's end."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient

from functions.gateway.app import create_app, new
from functions.runtime import Runtime
from openrl_core.settings import Settings
from tests.functions.audit.scenario import Stream
from tests.functions.gateway.sampling_rig import ALICE, MODEL, start


def test_the_gateway_function_runs_the_checkpoint_reaper(tmp_path):
    runtime = Runtime(Settings(data_dir=tmp_path))
    stream = Stream("alice", session="s1")
    stream.session_created(t=0)
    save = stream.save_weights("req-save", t=1)
    saved = stream.saved(save, t=2)
    expired = saved.model_copy(update={"data": saved.data.model_copy(update={
        "checkpoint": saved.data.checkpoint.model_copy(update={"expires_at": saved.time + timedelta(seconds=1)})})})  # fmt: skip
    for event in [*stream.events[:-1], expired]:
        runtime.store.append(event)
    assert runtime.projections.checkpoint("alice", stream.model, "weights/ckpt-1") is not None
    runtime.close()

    function = new()
    function.start({"data_dir": str(tmp_path), "checkpoint_reaper_seconds": "3600"})
    try:
        deadline = time.monotonic() + 10
        while function._runtime.projections.checkpoint("alice", stream.model, "weights/ckpt-1") is not None:
            assert time.monotonic() < deadline, "the reaper never removed the expired checkpoint"
            time.sleep(0.05)
        assert [t.name for t in function._threads] == ["reaper", "outbox"] and all(
            t.is_alive() for t in function._threads
        )
    finally:
        function.stop()
    assert not any(t.is_alive() for t in function._threads)


@pytest.mark.postgres
def test_a_sample_submitted_on_one_replica_wakes_a_poll_held_on_another(tmp_path, pg_url, tiny_files):
    replica_a, close = start(tmp_path / "a", database_url=pg_url, long_poll_seconds=20)
    runtime_b = Runtime(
        Settings(data_dir=tmp_path / "b", database_url=pg_url, models=[MODEL], api_keys=[f"alice={ALICE}"])
    )
    replica_b = TestClient(create_app(runtime_b.gateway_context()))
    replica_b.__enter__()
    try:
        body = {"target": {"type": "sampling_session", "sampling_session_id": replica_a.sampling_session_id, "cloned_sampler_id": 0},
                "prev_cursor": 0, "retrieved_request_ids": []}  # fmt: skip
        answers = []
        held = threading.Thread(
            target=lambda: answers.append((replica_a.post("/api/v1/retrieve_futures", body), time.monotonic()))
        )
        began = time.monotonic()
        held.start()
        time.sleep(0.5)  # the poll on replica A is now waiting, knowing of no samples
        sample = {"sampling_session_id": replica_a.sampling_session_id, "seq_id": 1, "num_samples": 1,
                  "prompt": {"chunks": [{"tokens": [1, 2, 3], "type": "encoded_text"}]},
                  "sampling_params": {"max_tokens": 4, "seed": 1}}  # fmt: skip
        submitted = replica_b.post("/api/v1/asample", json=sample, headers={"X-API-Key": ALICE})
        assert submitted.status_code == 200, submitted.text
        request_id = submitted.json()["request_id"]
        time.sleep(0.5)  # replica A has heard of it (NOTIFY) and watches its completion
        replica_a.finish_sample(request_id)
        held.join(25)
        [(answer, returned)] = answers
        assert [c["request_id"] for c in answer.json()["completions"]] == [request_id]
        assert returned - began < 5  # woken by the completion, not released by the 20 s window
    finally:
        replica_b.__exit__(None, None, None)
        runtime_b.close()
        close()
