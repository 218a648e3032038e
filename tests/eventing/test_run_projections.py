"""The per-step metrics, cancellation and fork folds, given hand-built events: what each step
sums, what a cancellation ends, what it leaves alone, what a fork records, and that replay
rebuilds the same rows; and a run's history as forking reads it."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from eventing.blobs import BlobStore
from eventing.codec import Codec
from eventing.replay import replay
from eventing.store import database
from eventing.store.event_store import EventStore
from eventing.store.queries import Projections
from eventing.store.run_history import run_history
from eventing.store.run_views import RunViews
from openrl_core.events import new_event
from openrl_core.events import sampling as sa
from openrl_core.events import training as te
from openrl_core.events.lifecycle import BlobRef, CheckpointSaved, RequestCompleted, RequestFailed, SamplingSessionBound
from openrl_core.events.recovery import SNAPSHOT_TAKEN, SnapshotTaken
from openrl_core.params import AdamParams, LoraConfig, SamplingParams

RUN = "s1:train:0"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


@pytest.fixture
def store(tmp_path):
    engine = database.make_engine(f"sqlite:///{tmp_path / 'events.db'}")
    database.upgrade(engine)
    yield EventStore(engine, Codec(BlobStore(tmp_path / "blobs")))
    engine.dispose()


def put(store, type_, payload, at: float) -> None:
    event = new_event(type_, payload, tenant="alice", source="/t", key=RUN)
    store.append(event.model_copy(update={"time": T0 + timedelta(seconds=at)}))


def fb(store, request_id, at, loss, tokens, forward_only=False, started=None):
    put(
        store,
        te.FORWARD_BACKWARD["requested"],
        te.ForwardBackwardRequested(request_id=request_id, model_id=RUN, seq_id=1, loss_fn="cross_entropy", data=[]),
        at,
    )
    details = {
        "tokens": tokens,
        "forward_only": forward_only,
        "started": (T0 + timedelta(seconds=started or at)).isoformat(),
    }
    result = {"metrics": {"loss:sum": loss}, "loss_fn_outputs": []}
    put(
        store,
        te.FORWARD_BACKWARD["completed"],
        RequestCompleted(request_id=request_id, result=result, details=details),
        at + 1,
    )


def optim(store, request_id, at, lr, grad_norm):
    put(
        store,
        te.OPTIM_STEP["requested"],
        te.OptimStepRequested(request_id=request_id, model_id=RUN, seq_id=2, adam_params=AdamParams(learning_rate=lr)),
        at,
    )
    result = {"metrics": {"optim/grad_norm": grad_norm, "optim/lr": lr}}
    put(store, te.OPTIM_STEP["completed"], RequestCompleted(request_id=request_id, result=result), at + 1)


def create(store):
    put(store, te.CREATE_MODEL["requested"], te.CreateModelRequested(request_id="c", session_id="s1", model_id=RUN, model_seq_id=0,
                                                                     base_model="m", lora_config=LoraConfig(rank=4)), 0)  # fmt: skip
    put(store, te.CREATE_MODEL["completed"], RequestCompleted(request_id="c", result={}), 0)


def test_a_step_sums_its_training_calls_and_skips_forward_only_ones(store):
    create(store)
    fb(store, "f1", at=10, loss=2.5, tokens=7, started=10.5)
    fb(store, "f2", at=11, loss=1.25, tokens=3)
    fb(store, "fwd", at=12, loss=100.0, tokens=50, forward_only=True)  # evaluation: no step of its own
    optim(store, "o1", at=13, lr=1e-3, grad_norm=0.5)
    fb(store, "f3", at=20, loss=2.0, tokens=7)
    optim(store, "o2", at=21, lr=2e-3, grad_norm=0.25)
    fb(store, "f4", at=30, loss=9.0, tokens=1)  # the step in progress is not listed yet
    first, second = RunViews(store.engine).steps(RUN)
    assert (first.step, first.loss, first.tokens, first.forward_backward) == (1, 3.75, 10, 2)
    assert (first.learning_rate, first.grad_norm) == (1e-3, 0.5)
    assert (second.step, second.loss, second.tokens, second.learning_rate) == (2, 2.0, 7, 2e-3)
    run = RunViews(store.engine).run("alice", RUN)
    assert run.steps == 2 and RunViews.status(run) == "active"


def test_cancel_ends_open_futures_and_sampling_sessions_and_keeps_later_work_out(store, tmp_path):
    create(store)
    fb(store, "f1", at=10, loss=1.0, tokens=1)
    optim(store, "o1", at=11, lr=1e-3, grad_norm=0.5)
    put(
        store,
        te.SAVE_WEIGHTS_FOR_SAMPLER["requested"],
        te.SaveWeightsForSamplerRequested(request_id="p", model_id=RUN, seq_id=3, sampling_session_id="s1:sample:0"),
        12,
    )
    bound = SamplingSessionBound(
        sampling_session_id="s1:sample:0",
        session_id="s1",
        base_model="m",
        adapter={"a": BlobRef(sha256="c" * 64, size=1)},
    )
    put(
        store,
        te.SAVE_WEIGHTS_FOR_SAMPLER["completed"],
        RequestCompleted(request_id="p", result={}, sampling_session=bound),
        13,
    )
    put(store, sa.SAMPLE["requested"], sa.SampleRequested(request_id="r", sampling_session_id="s1:sample:0", seq_id=0, base_model="m",
                                                          prompt_tokens=[1], num_samples=1, sampling_params=SamplingParams(), sample_sequence_ids=["r:0"]), 14)  # fmt: skip
    put(
        store,
        te.FORWARD_BACKWARD["requested"],
        te.ForwardBackwardRequested(request_id="late", model_id=RUN, seq_id=4, loss_fn="cross_entropy", data=[]),
        15,
    )
    put(
        store,
        te.SAVE_WEIGHTS["requested"],
        te.SaveWeightsRequested(request_id="w", model_id=RUN, seq_id=5, name="final"),
        15,
    )

    put(store, te.RUN_CANCELLED, te.RunCancelled(model_id=RUN, reason="enough", by="operator"), 16)
    put(store, te.RUN_CANCELLED, te.RunCancelled(model_id=RUN), 17)  # a second one changes nothing
    # The trainer ran them before it saw the cancellation: their results are not taken.
    put(
        store,
        te.FORWARD_BACKWARD["completed"],
        RequestCompleted(request_id="late", result={"metrics": {"loss:sum": 5.0}}),
        18,
    )
    saved = CheckpointSaved(run_id=RUN, kind="weights", name="final", files={"a": BlobRef(sha256="b" * 64, size=3)})
    put(store, te.SAVE_WEIGHTS["completed"], RequestCompleted(request_id="w", result={}, checkpoint=saved), 18)

    live = Projections(store.engine)
    for request_id in ("late", "w", "r"):
        future = live.future("alice", request_id)
        assert future.state == "cancelled" and future.category == "user", request_id
        assert future.error.startswith(f"cancelled: training run {RUN!r} was cancelled by an operator: enough")
        assert future.completed_at.replace(tzinfo=timezone.utc) == T0 + timedelta(seconds=16)
    assert live.future("alice", "o1").state == "completed"  # finished work stays as it was
    run = live.run("alice", RUN)
    assert run.state == "cancelled" and run.cancelled_at.replace(tzinfo=timezone.utc) == T0 + timedelta(seconds=16)
    assert live.sampling_session("alice", "s1:sample:0").closed_at is not None
    assert live.checkpoint("alice", RUN, "weights/final") is None
    assert [s.step for s in RunViews(store.engine).steps(RUN)] == [1]
    assert len(live.table_rows("run_steps")) == 1  # the late forward_backward opened no step

    engine = database.make_engine(f"sqlite:///{tmp_path / 'replay.db'}")
    database.upgrade(engine)
    report = replay(store, live, EventStore(engine, store.codec), Projections(engine))
    engine.dispose()
    assert report.differences == []


def fork_event(request_id: str, fork_id: str, step: int) -> te.ForkRequested:
    return te.ForkRequested(request_id=request_id, model_id=fork_id, session_id=fork_id.split(":")[0], parent_id=RUN, step=step,
                            parent_seq_id=2 * step, base_model="m", lora_config=LoraConfig(rank=4), project_id="p",
                            origin=te.Replayed(type=te.CREATE_MODEL["requested"], data={}), checkpoint_name=f"forked-at-step-{step}")  # fmt: skip


def test_a_fork_is_a_run_with_its_parent_and_step_in_a_session_of_its_own(store, tmp_path):
    create(store)
    fb(store, "f1", at=10, loss=1.0, tokens=1)
    optim(store, "o1", at=11, lr=1e-3, grad_norm=0.5)
    put(store, te.FORK["requested"], fork_event("k1", "f1s:train:0", 1), 20)
    live, views = Projections(store.engine), RunViews(store.engine)
    forked = views.run("alice", "f1s:train:0")
    assert (forked.state, forked.forked_from_run, forked.forked_from_step, forked.lora_rank) == ("creating", RUN, 1, 4)
    session = live.session("alice", "f1s")
    assert session.tags == ["fork"] and session.project_id == "p" and session.display_name == f"fork of {RUN} at step 1"
    assert views.fork_request("alice", "f1s:train:0") == "k1" and views.fork_request("bob", "f1s:train:0") is None

    saved = CheckpointSaved(
        run_id="f1s:train:0", kind="weights", name="forked-at-step-1", files={"a": BlobRef(sha256="d" * 64, size=3)}
    )
    put(store, te.FORK["completed"], RequestCompleted(request_id="k1", result={"type": "fork"}, checkpoint=saved), 21)
    assert views.run("alice", "f1s:train:0").state == "ready"
    assert live.checkpoint("alice", "f1s:train:0", "weights/forked-at-step-1").files == {
        "a": {"sha256": "d" * 64, "size": 3}
    }
    # A redelivered completion, with other files, changes nothing.
    other = saved.model_copy(update={"files": {"a": BlobRef(sha256="e" * 64, size=3)}})
    put(store, te.FORK["completed"], RequestCompleted(request_id="k1", result={}, checkpoint=other), 22)
    assert live.checkpoint("alice", "f1s:train:0", "weights/forked-at-step-1").files["a"]["sha256"] == "d" * 64

    put(store, te.FORK["requested"], fork_event("k2", "f2s:train:0", 0), 30)
    put(store, te.FORK["failed"], RequestFailed(request_id="k2", error="blob gone", category="server"), 31)
    failed = views.run("alice", "f2s:train:0")
    assert (failed.state, failed.error) == ("failed", "blob gone")
    assert live.checkpoint("alice", "f2s:train:0", "weights/forked-at-step-0") is None

    engine = database.make_engine(f"sqlite:///{tmp_path / 'replay.db'}")
    database.upgrade(engine)
    report = replay(store, live, EventStore(engine, store.codec), Projections(engine))
    engine.dispose()
    assert report.differences == []


def test_run_history_reads_the_runs_requests_outcomes_and_snapshots(store):
    create(store)
    fb(store, "f1", at=10, loss=1.0, tokens=1)
    optim(store, "o1", at=11, lr=1e-3, grad_norm=0.5)
    put(
        store,
        te.OPTIM_STEP["requested"],
        te.OptimStepRequested(request_id="o2", model_id=RUN, seq_id=3, adam_params=AdamParams()),
        12,
    )
    put(store, te.OPTIM_STEP["failed"], RequestFailed(request_id="o2", error="x"), 13)
    put(
        store,
        te.SAVE_WEIGHTS["requested"],
        te.SaveWeightsRequested(request_id="w", model_id=RUN, seq_id=4, name="n"),
        14,
    )
    snapshot = SnapshotTaken(
        model_id=RUN, session_id="s1", base_model="m", lora_config=LoraConfig(rank=4), next_seq=3, files={}, taken_at=T0
    )
    put(store, SNAPSHOT_TAKEN, snapshot, 15)
    history = run_history(store, "alice", RUN)
    assert history.origin.type == te.CREATE_MODEL["requested"] and [s.next_seq for s in history.snapshots] == [3]
    assert [(e.seq_id, e.verb, e.outcome) for e in history.logged] == [
        (1, "forward_backward", "completed"), (2, "optim_step", "completed"), (3, "optim_step", "ended"), (4, "other", "unfinished"),
    ]  # fmt: skip
    assert run_history(store, "bob", RUN).origin is None  # another tenant's run has no history to read
