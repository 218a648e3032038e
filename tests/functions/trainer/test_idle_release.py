"""Idle runs are released from the trainer's memory and come back from their snapshot.

A run that sent nothing for `release_runs_after` seconds loses its adapter, optimizer state
and timeslicer job here, once a durable snapshot covers all it applied (one is taken for it);
its next request restores that snapshot, and on CPU the run then ends bitwise where a run
never released ends. A run with gradients pending, or with a request held back by its seq
gate, is kept: a snapshot could not hold that state.
"""

from __future__ import annotations

import time

import numpy as np

from functions.trainer.worker import TrainerOptions
from openrl_core.catalog import TINY_QWEN3
from openrl_core.events.recovery import SNAPSHOT_TAKEN
from tests.functions.trainer.test_recovery import MODEL_ID, TENANT, Node, history, publish, uninterrupted

AFTER = 0.3  # seconds idle before a run is released


def idle_for(node: Node, seconds: float) -> dict:
    """Idle loops of the worker for about `seconds`; the completions (and snapshots) seen."""
    seen, deadline = {}, time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.update(node.run_until([], rounds=1))
    return seen


def released(node: Node, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while MODEL_ID in node.worker.slots and time.monotonic() < deadline:
        node.worker.run_once(timeout=0.05)
    return MODEL_ID not in node.worker.slots


def test_an_idle_run_is_released_and_its_next_request_restores_it_bitwise(tmp_path, tiny_files):
    events = history()
    ids = ["create"] + [e.data.request_id for e in events[1:]]
    expected, expected_steps = uninterrupted(tmp_path / "reference", events)

    # No periodic snapshot in the way (every 100 steps): the release takes its own.
    node = Node(tmp_path / "released", every=100, options=TrainerOptions(release_runs_after=AFTER))
    publish(node, events[:5])  # create, fb1, op2, fb3, op4
    assert node.run_until(ids[:5]).keys() >= set(ids[:5])
    job = node.worker._job(MODEL_ID)
    assert MODEL_ID in node.worker.slots and node.worker.slicer.registered(job)
    assert released(node)
    engine = node.worker.engine(TINY_QWEN3)
    assert not engine.has_adapter(MODEL_ID) and not node.worker.slicer.registered(job)
    snapshot = node.worker.recovery.latest(TENANT, MODEL_ID)
    assert snapshot is not None and snapshot.next_seq == 5  # everything through op4

    publish(node, events[5:])  # the run comes back
    done = node.run_until(ids[5:])
    assert set(ids[5:]) <= set(done), sorted(done)
    assert node.worker.slots[MODEL_ID].gate.next_seq == 11
    weights, steps = node.weights()
    assert steps == expected_steps  # no optimizer step lost or applied twice
    for name, value in expected.items():
        assert np.array_equal(weights[name], value), name  # bitwise


def test_a_covered_run_is_released_without_a_new_snapshot(tmp_path, tiny_files):
    node = Node(tmp_path, every=2, options=TrainerOptions(release_runs_after=AFTER))
    publish(node, history()[:5])  # a periodic snapshot after op4 covers all of it
    node.run_until(["create", "fb1", "op2", "fb3", "op4"])
    node.worker.recovery.snapshotter.drain()
    seen = node.run_until([SNAPSHOT_TAKEN], rounds=20)
    assert seen[SNAPSHOT_TAKEN].data.next_seq == 5
    assert released(node)
    assert SNAPSHOT_TAKEN not in idle_for(node, 0.3)  # nothing more was written for the release


def test_pending_gradients_or_a_held_request_keep_a_run(tmp_path, tiny_files):
    events = history()  # create, fb1, op2, fb3, op4, fb5, op6, fb7, op8, fb9, op10
    node = Node(tmp_path, every=100, options=TrainerOptions(release_runs_after=AFTER))
    slots = node.worker.slots
    publish(node, events[:4])  # up to fb3: its gradients wait for op4
    node.run_until(["create", "fb1", "op2", "fb3"])
    idle_for(node, 3 * AFTER)
    assert MODEL_ID in slots  # a snapshot would lose fb3's gradients
    publish(node, [events[7]])  # fb7 while seq 5 and 6 are missing: held by the gate
    publish(node, [events[4]])  # op4: clean again, but fb7 is still held
    node.run_until(["op4"])
    idle_for(node, 3 * AFTER)
    assert MODEL_ID in slots and slots[MODEL_ID].gate.held == [7]
    publish(node, events[5:7])  # fb5, op6, and then the held fb7 runs: gradients pending again
    node.run_until(["fb5", "op6", "fb7"])
    assert not slots[MODEL_ID].gate.held
    idle_for(node, 3 * AFTER)
    assert MODEL_ID in slots
    publish(node, [events[8]])  # op8: a clean point at last
    node.run_until(["op8"])
    assert released(node)


def test_release_is_off_by_default_and_without_snapshots(tmp_path, tiny_files):
    for name, every, options in (
        ("default", 100, TrainerOptions()),
        ("no-snapshots", 0, TrainerOptions(release_runs_after=AFTER)),
    ):
        node = Node(tmp_path / name, every=every, options=options)
        publish(node, history()[:3])
        node.run_until(["create", "fb1", "op2"])
        idle_for(node, 3 * AFTER)
        assert MODEL_ID in node.worker.slots, name
