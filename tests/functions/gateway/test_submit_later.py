"""Training submissions wait for their append on the event loop, not in a gateway thread
(`functions.gateway.submit.submitting`): no thread is held while the appender's writer
writes, the client still hears of its future only once the event is stored and on the log,
and a tenant with quotas keeps the synchronous path that holds its admission lock."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from eventing import topics
from eventing.store import tables
from eventing.store.event_store import Appended
from functions.gateway.app import create_app
from functions.gateway.routes.training import _optim_step
from functions.gateway.submit import submitting
from functions.runtime import Runtime
from openrl_core.settings import Settings
from tests.functions.gateway.test_fast_lane import ALICE, MODEL, count, model_of, post


def rig_for(tmp_path, **settings):
    runtime = Runtime(
        Settings(data_dir=tmp_path, models=[MODEL], api_keys=[f"alice={ALICE}"], gateway_threads=2, **settings)
    )
    ctx = runtime.gateway_context()
    return runtime, ctx, create_app(ctx)


@pytest.fixture
def rig(tmp_path, tiny_files):
    runtime, ctx, app = rig_for(tmp_path)
    with TestClient(app) as client:
        yield client, runtime, ctx
    runtime.close()


def gate_writes(ctx):
    """Hold every append batch of the appender until the returned event is set; records batches."""
    group = ctx.appender._group
    write, gate, batches = group._write_batch, threading.Event(), []

    def held(items):
        batches.append([event.type for event, _topic, _dedup in items])
        gate.wait(20)
        return write(items)

    group._write_batch = held
    return gate, batches


def test_submissions_waiting_on_a_slow_write_hold_no_gateway_thread(tmp_path, tiny_files):
    """Two gateway threads, six concurrent optim_steps, the log's write held (a broker slow to
    acknowledge): had each request held its thread until its write, two would have taken
    both threads and the rest, and every read behind them, would wait. All six reach the
    appender, the five behind the held one go in one batch, and a long-poll's store read
    still answers meanwhile."""
    runtime, ctx, app = rig_for(tmp_path, long_poll_seconds=0.3)
    with TestClient(app) as client:
        model_id = model_of(client)
        pending = post(client, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 1}).json()["request_id"]
        gate, batches = gate_writes(ctx)
        steps = [{"model_id": model_id, "seq_id": seq, "adam_params": {"learning_rate": 1e-4}} for seq in range(2, 8)]
        with ThreadPoolExecutor(7) as pool:
            try:
                first = pool.submit(post, client, "/api/v1/optim_step", steps[0])
                while not batches:
                    time.sleep(0.005)
                rest = [pool.submit(post, client, "/api/v1/optim_step", step) for step in steps[1:]]
                deadline = time.monotonic() + 10
                while len(ctx.appender._group._queue) < 5 and time.monotonic() < deadline:
                    time.sleep(0.005)
                assert len(ctx.appender._group._queue) == 5  # queued while the first write is held
                assert not first.done() and not any(answer.done() for answer in rest)  # none answered before its write
                poll = pool.submit(post, client, "/api/v1/retrieve_future", {"request_id": pending}).result(10)
                assert poll.status_code == 408  # read in a gateway thread, held the 0.3 s window, answered
            finally:
                gate.set()
            answers = [future.result(20) for future in [first, *rest]]
    runtime.close()
    assert [answer.status_code for answer in answers] == [200] * 6
    assert len({answer.json()["request_id"] for answer in answers}) == 6
    assert len(batches) == 2 and len(batches[1]) == 5
    assert count(runtime, "optim_step.requested") == 7


def test_an_answered_future_is_stored_and_on_the_log(rig):
    client, runtime, ctx = rig
    model_id = model_of(client)
    consumer = runtime.bus.consumer("test-reader", pattern=topics.pattern("training", [MODEL]))
    request_id = post(client, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 1}).json()["request_id"]
    # Read at once after the answer: nothing of it may still be on its way.
    assert ctx.projections.future("alice", request_id) is not None
    seen = []
    deadline = time.monotonic() + 5
    while request_id not in seen and time.monotonic() < deadline:
        for record in consumer.poll(max_records=100, timeout=0.2):
            event = runtime.store.codec.decode(record.message)
            seen.append(getattr(event.data, "request_id", None))
    assert request_id in seen
    with runtime.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(tables.outbox)).scalar() == 0  # published, then cleared
    consumer.close()


def test_duplicates_and_conflicts_answer_through_the_loop_as_in_a_thread(rig):
    client, runtime, ctx = rig
    model_id = model_of(client)
    step = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-4}}
    first = post(client, "/api/v1/optim_step", step)
    again = post(client, "/api/v1/optim_step", step)
    assert again.status_code == 200 and again.json() == first.json()  # the retry gets the first future
    other = post(client, "/api/v1/optim_step", {**step, "adam_params": {"learning_rate": 0.5}})
    assert (
        other.status_code == 409 and "already submitted with a different body" in other.text
    )  # the store's Conflict, raised on the loop
    assert count(runtime, "optim_step.requested") == 1


def test_a_tenant_with_quotas_is_admitted_and_appended_in_its_thread(tmp_path, tiny_files):
    """The check and the append must run under the tenant's lock, which a thread holds: the
    append is not handed to the loop, and the limit still holds."""
    runtime, ctx, app = rig_for(tmp_path, quota_requests_in_flight=2)
    later_calls: list[str] = []
    appended_in: list[str] = []
    append_later, append = ctx.appender.append_later, ctx.appender.append

    def spy_later(*args):
        later_calls.append("later")
        return append_later(*args)

    def spy_append(*args) -> Appended:
        appended_in.append(threading.current_thread().name)
        return append(*args)

    ctx.appender.append_later, ctx.appender.append = spy_later, spy_append
    with TestClient(app) as client:
        model_id = model_of(client)  # create_model: one request in flight
        answers = [post(client, "/api/v1/optim_step", {"model_id": model_id, "seq_id": seq}) for seq in (1, 2)]
    runtime.close()
    assert [answer.status_code for answer in answers] == [200, 429]
    assert "requests_in_flight" in answers[1].text and answers[1].headers["retry-after"]
    assert later_calls == []
    # create_session appends from FastAPI's own pool; create_model and the admitted optim_step in ours
    assert [name.split("_")[0] for name in appended_in[1:]] == ["gateway", "gateway"]


def test_a_route_that_does_more_after_a_deferred_submit_is_a_loud_error(rig):
    """Work after a deferred submit would run before its event is stored: `submitting`
    refuses a function whose answer is not its Later, and a second deferred submit."""
    client, _runtime, ctx = rig
    model_id = model_of(client)

    def step(seq: int) -> bytes:
        return json.dumps({"model_id": model_id, "seq_id": seq}).encode()

    def answers_something_else(*_args):
        _optim_step(ctx, "alice", step(1))
        return None

    def submits_twice(*_args):
        _optim_step(ctx, "alice", step(2))
        return _optim_step(ctx, "alice", step(3))

    with pytest.raises(RuntimeError, match="must be what it returns"):
        asyncio.run(submitting(ctx, answers_something_else, "alice", b""))
    with pytest.raises(RuntimeError, match="one deferred submit"):
        asyncio.run(submitting(ctx, submits_twice, "alice", b""))
    answered = asyncio.run(submitting(ctx, _optim_step, "alice", step(4)))
    assert answered.request_id  # and the thread's state was reset between calls


def record_read_threads(ctx) -> list[str]:
    """Names of the threads that read a training run for a submission."""
    read, names = ctx.projections.run, []

    def recorded(*args, **kwargs):
        names.append(threading.current_thread().name)
        return read(*args, **kwargs)

    ctx.projections.run = recorded
    return names


@pytest.mark.parametrize("inline_bytes, in_a_gateway_thread", [(64 * 1024, False), (0, True), (8, True)])
def test_a_small_submission_on_sqlite_runs_on_the_event_loop_and_a_large_one_in_a_thread(
    tmp_path, tiny_files, inline_bytes, in_a_gateway_thread
):
    """`gateway_inline_body_bytes`: up to that size a submission's check and queueing run on
    the event loop (no hop to a thread); 0 turns it off, and a body over it goes to a thread."""
    runtime, ctx, app = rig_for(tmp_path, gateway_inline_body_bytes=inline_bytes)
    with TestClient(app) as client:
        model_id = model_of(client)
        names = record_read_threads(ctx)
        answer = post(client, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 1})
        assert answer.status_code == 200
        assert [name.startswith("gateway") for name in names] == [in_a_gateway_thread]
        assert count(runtime, "optim_step.requested") == 1
    runtime.close()


@pytest.mark.parametrize("case", ["quotas", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_quota_tenants_submission_and_any_on_postgresql_stay_in_a_thread(tmp_path, tiny_files, request, case):
    """A quota tenant's submission waits for its append under the tenant's lock, and a
    PostgreSQL read is a network round trip (which hangs while the database is away): neither
    runs on the loop."""
    settings = (
        {"quota_requests_in_flight": 100} if case == "quotas" else {"database_url": request.getfixturevalue("pg_url")}
    )
    runtime, ctx, app = rig_for(tmp_path, **settings)
    with TestClient(app) as client:
        model_id = model_of(client)
        names = record_read_threads(ctx)
        assert post(client, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 1}).status_code == 200
        assert len(names) == 1 and names[0].startswith("gateway")
    runtime.close()


def test_a_refusal_is_answered_once_its_skip_is_stored_and_holds_no_thread(tmp_path, tiny_files):
    """A refused training request consumes its seq_id: the 400 comes only after the trainer's
    `seq.skipped` is stored and on the log, and while that write waits no thread is held."""
    runtime, ctx, app = rig_for(tmp_path)
    with TestClient(app) as client:
        model_id = model_of(client)
        names = record_read_threads(ctx)
        gate, batches = gate_writes(ctx)
        bad = {"model_id": model_id, "seq_id": 1, "optimizer_params": {"type": "sgd"}}
        with ThreadPoolExecutor(2) as pool:
            try:
                refused = pool.submit(post, client, "/api/v1/optim_step", bad)
                deadline = time.monotonic() + 10
                while not batches and time.monotonic() < deadline:
                    time.sleep(0.005)
                assert batches == [["ai.openrl.training.seq.skipped.v1"]]
                time.sleep(0.1)
                assert not refused.done()  # not answered before its skip is written
                assert len(names) == 1 and not names[0].startswith(
                    "gateway"
                )  # checked on the loop, which waits for nothing:
                assert pool.submit(client.get, "/api/v1/healthz").result(5).status_code == 200  # it answers meanwhile
            finally:
                gate.set()
            answer = refused.result(20)
    assert answer.status_code == 400 and "sgd" in answer.json()["detail"]
    assert count(runtime, "seq.skipped") == 1
    runtime.close()
