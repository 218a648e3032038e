"""The trainer's turn order as a pure queue: round-robin over tenants, then models in arrival
order; each model's requests in order; a tenant that becomes ready waits behind one turn of
each tenant already queued, however many models those have."""

from __future__ import annotations

from openrl_core.fairness import FairQueue


def drain(queue: FairQueue) -> list[tuple[str, str, list]]:
    out = []
    while (turn := queue.pop()) is not None:
        out.append(turn)
    return out


def test_tenants_take_turns_and_a_tenants_models_keep_arrival_order():
    queue: FairQueue[int] = FairQueue()
    for model in ("a1", "a2", "a3"):
        queue.add("alice", model, [1])
    queue.add("bob", "b1", [1])
    queue.add("carol", "c1", [1])
    queue.add("bob", "b2", [1])
    assert [(t, m) for t, m, _ in drain(queue)] == [
        ("alice", "a1"), ("bob", "b1"), ("carol", "c1"), ("alice", "a2"), ("bob", "b2"), ("alice", "a3"),
    ]  # fmt: skip
    assert len(queue) == 0 and queue.pop() is None


def test_a_models_requests_stay_in_order_and_join_its_queued_turn():
    queue: FairQueue[int] = FairQueue()
    queue.add("alice", "a1", [1, 2])
    queue.add("alice", "a2", [1])
    queue.add("alice", "a1", [3])  # arrived later: after its own queued requests, in the same turn
    queue.add("alice", "a1", [])  # nothing ready: no turn
    assert drain(queue) == [("alice", "a1", [1, 2, 3]), ("alice", "a2", [1])]


def test_a_tenant_that_becomes_ready_mid_round_waits_for_one_turn_not_all_of_another_tenants():
    queue: FairQueue[int] = FairQueue()
    for index in range(8):
        queue.add("flood", f"f{index}", [1])
    assert queue.pop()[1] == "f0"  # running
    queue.add("light", "l0", [1])  # arrives meanwhile
    assert queue.pop()[1] == "f1"  # the flood's turn that was already next in the ring
    assert queue.pop()[1] == "l0"
    assert [m for _, m, _ in drain(queue)] == [f"f{index}" for index in range(2, 8)]


def test_discard_removes_a_models_turn_and_an_emptied_tenant():
    queue: FairQueue[int] = FairQueue()
    queue.add("alice", "a1", [1, 2])
    queue.add("bob", "b1", [1])
    assert queue.discard("a1") == [1, 2] and queue.discard("a1") == [] and queue.discard("nope") == []
    assert drain(queue) == [("bob", "b1", [1])]
