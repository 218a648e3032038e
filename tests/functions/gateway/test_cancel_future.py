"""cancel_future: a sample the sampler has not taken yet is never run and ends CANCELLED; one
that is running or finished is unaffected; cancelling twice is cancelling once; training
futures are not cancellable; another tenant's id is unknown."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import func, select

from eventing.store import tables
from functions.sampler.worker import SamplerWorker
from openrl_core.events.sampling import SAMPLE_CANCEL_REQUESTED, SAMPLE_CANCELLED
from tests.functions.gateway.sampling_rig import BOB, MODEL, start


@pytest.fixture
def rig(tmp_path, tiny_files):
    rig, close = start(tmp_path)
    rt = rig.runtime
    worker = SamplerWorker(rt.bus, rt.publisher, rt.blobs, rt.models, linger=0.05)
    yield rig, worker
    worker.consumer.close()
    close()


def cancel(rig, request_id, key=None):
    return rig.post("/api/v1/cancel_future", {"request_id": request_id}, **({"key": key} if key else {}))


def settled(rig, request_id):
    """The future's final answer (the projector runs in its own thread)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answer = rig.post("/api/v1/retrieve_future", {"request_id": request_id}, Accept="application/x-protobuf")
        if answer.status_code == 200:
            return answer
    raise AssertionError(f"{request_id} never settled")


def count(rig, type_):
    with rig.runtime.engine.connect() as conn:
        return conn.execute(select(func.count()).where(tables.events.c.type == type_)).scalar()


def test_a_sample_cancelled_before_it_started_never_runs(rig):
    rig, worker = rig
    ran = []
    engine = worker.engine(MODEL)
    original = engine.sample
    engine.sample = lambda jobs: (ran.append(len(jobs)), original(jobs))[1]
    doomed, kept = rig.sample(seq_id=1), rig.sample(seq_id=2)
    answer = cancel(rig, doomed)
    assert answer.status_code == 200 and answer.json() == {"request_id": doomed, "status": "cancel_requested"}
    assert cancel(rig, doomed).json()["status"] == "cancel_requested"  # again: still one request
    assert count(rig, SAMPLE_CANCEL_REQUESTED) == 1

    worker.run_once(timeout=1.0)
    assert ran == [1]  # only the other sample went to the engine
    assert settled(rig, doomed).json() == {"error": "cancelled by the client before it started", "category": "user"}
    assert settled(rig, kept).headers["content-type"] == "application/x-protobuf"
    assert count(rig, SAMPLE_CANCELLED) == 1
    # the feed reports it as failed, and a late cancel changes nothing
    feed = rig.post(
        "/api/v1/retrieve_futures", {"target": {"sampling_session_id": rig.sampling_session_id}, "timeout": 0}
    ).json()
    assert {c["request_id"]: c["state"] for c in feed["completions"]} == {doomed: "failed", kept: "finished"}
    assert cancel(rig, doomed).json()["status"] == "already_finished"
    assert count(rig, SAMPLE_CANCEL_REQUESTED) == 1


def test_a_running_sample_is_unaffected(rig):
    rig, worker = rig
    engine = worker.engine(MODEL)
    original = engine.sample
    request_id = rig.sample()
    answers = []

    def cancel_while_running(jobs):
        answers.append(cancel(rig, request_id).json())  # the cancel reaches the log now
        return original(jobs)

    engine.sample = cancel_while_running
    worker.run_once(timeout=1.0)
    assert answers == [{"request_id": request_id, "status": "cancel_requested"}]
    engine.sample = original
    worker.run_once(timeout=0.5)  # takes the late cancel: nothing left to cancel
    assert settled(rig, request_id).headers["content-type"] == "application/x-protobuf"
    assert count(rig, SAMPLE_CANCELLED) == 0


def test_a_finished_sample_is_unaffected(rig):
    rig, worker = rig
    request_id = rig.sample()
    worker.run_once(timeout=1.0)
    before = settled(rig, request_id).content
    assert cancel(rig, request_id).json()["status"] == "already_finished"
    assert count(rig, SAMPLE_CANCEL_REQUESTED) == 0
    assert settled(rig, request_id).content == before


def test_training_futures_are_not_cancellable_and_tenancy_holds(rig):
    rig, _worker = rig
    model = rig.post(
        "/api/v1/create_model",
        {"session_id": rig.session_id, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 4}},
    ).json()
    answer = rig.post("/api/v1/optim_step", {"model_id": model["model_id"], "seq_id": 1})
    assert answer.status_code == 200, answer.text
    step = answer.json()["request_id"]
    assert cancel(rig, step).json() == {"request_id": step, "status": "not_cancellable"}
    sample = rig.sample()
    answer = cancel(rig, sample, key=BOB)
    assert answer.status_code == 404 and sample in answer.json()["detail"]
    assert cancel(rig, "req-nope").status_code == 404
    assert count(rig, SAMPLE_CANCEL_REQUESTED) == 0
