"""Finished futures in memory: only terminal rows, only after commit, the tenant's own, bounded."""

from __future__ import annotations

from eventing.store.finished import FinishedFutures
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.events.lifecycle import RequestCompleted
from openrl_core.params import AdamParams


def row(request_id: str, state: str, tenant: str = "alice") -> dict:
    return {"request_id": request_id, "tenant": tenant, "state": state, "kind": "optim_step", "result": {"metrics": {}}}


def test_only_terminal_rows_are_kept_and_only_for_their_tenant():
    finished = FinishedFutures(capacity=8)
    finished.put_many([row("r1", "completed"), row("r2", "pending"), row("r3", "failed", tenant="bob")])
    assert finished.get("alice", "r1").state == "completed"
    assert finished.get("alice", "r2") is None  # not finished: the store answers
    assert finished.get("alice", "r3") is None and finished.get("bob", "r3").state == "failed"


def test_the_least_recently_finished_leave_first():
    finished = FinishedFutures(capacity=2)
    finished.put_many([row("r1", "completed"), row("r2", "completed")])
    finished.put_many([row("r3", "cancelled")])
    assert finished.get("alice", "r1") is None
    assert finished.get("alice", "r2") is not None and finished.get("alice", "r3") is not None


def test_the_store_keeps_what_a_committed_batch_finished_as_the_store_has_it(store):
    store, reads = store
    requested = te.OptimStepRequested(request_id="r1", model_id="m", seq_id=1, adam_params=AdamParams())
    store.append(new_event(te.OPTIM_STEP["requested"], requested, tenant="alice", source="/t", key="m"))
    assert store.finished.get("alice", "r1") is None  # pending
    done = RequestCompleted(request_id="r1", result={"metrics": {"optim/lr": 0.1}})
    store.append_batch([(new_event(te.OPTIM_STEP["completed"], done, tenant="alice", source="/t", key="m"), None)])
    kept, stored = store.finished.get("alice", "r1"), reads.future("alice", "r1")
    assert kept is not None and (kept.state, kept.result, kept.kind) == (stored.state, stored.result, stored.kind)


# -- pending futures: a hint for the gateway's first look, only where it was asked for ------


def test_pending_is_never_said_unless_followed():
    finished = FinishedFutures()
    finished.put_many([row("r1", "pending")])
    assert not finished.pending("alice", "r1")  # off by default: a gateway beside no projector would wait on it


def test_followed_pending_futures_until_they_finish_and_only_for_their_tenant():
    finished = FinishedFutures()
    finished.put_many([row("before", "pending")])
    finished.follow_pending()
    assert not finished.pending("alice", "before")  # committed before following: unknown, not running
    finished.put_many([row("r1", "pending"), row("r2", "running"), row("r3", "pending", tenant="bob")])
    assert finished.pending("alice", "r1") and finished.pending("alice", "r2")
    assert not finished.pending("alice", "r3") and finished.pending("bob", "r3")
    assert not finished.pending("alice", "unknown")
    finished.put_many([row("r1", "completed"), row("r3", "cancelled", tenant="bob")])
    assert not finished.pending("alice", "r1") and not finished.pending("bob", "r3")
    assert finished.get("alice", "r1").state == "completed"
    finished.put_many([row("r2", "failed")])
    assert not finished.pending("alice", "r2")


def test_followed_pending_futures_are_bounded_the_oldest_forgotten_first():
    finished = FinishedFutures(pending_capacity=2)
    finished.follow_pending()
    finished.put_many([row("r1", "pending"), row("r2", "pending")])
    finished.put_many([row("r3", "pending")])
    assert [finished.pending("alice", r) for r in ("r1", "r2", "r3")] == [False, True, True]


def test_the_store_notes_what_it_committed_unfinished_and_forgets_it_once_it_finished(store):
    store, _reads = store
    store.finished.follow_pending()
    requested = te.OptimStepRequested(request_id="r1", model_id="m", seq_id=1, adam_params=AdamParams())
    store.append(new_event(te.OPTIM_STEP["requested"], requested, tenant="alice", source="/t", key="m"))
    assert store.finished.pending("alice", "r1") and not store.finished.pending("bob", "r1")
    done = RequestCompleted(request_id="r1", result={"metrics": {}})
    store.append_batch([(new_event(te.OPTIM_STEP["completed"], done, tenant="alice", source="/t", key="m"), None)])
    assert not store.finished.pending("alice", "r1") and store.finished.get("alice", "r1") is not None


def test_announced_futures_and_a_gap_drop_their_pending_hints():
    finished = FinishedFutures()
    finished.forget_pending(["r1"])  # not followed: nothing to forget, nothing raised
    finished.clear_pending()
    finished.follow_pending()
    finished.put_many([row("r1", "pending"), row("r2", "running"), row("r3", "pending")])
    finished.forget_pending(["r1", "unknown"])  # another process's projector announced r1
    assert not finished.pending("alice", "r1")
    assert finished.pending("alice", "r2") and finished.pending("alice", "r3")
    finished.clear_pending()  # announcements may have been missed: no hint is trusted
    assert not finished.pending("alice", "r2") and not finished.pending("alice", "r3")
    finished.put_many([row("r4", "pending")])  # still followed after a gap
    assert finished.pending("alice", "r4")
