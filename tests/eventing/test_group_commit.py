"""Group commit: concurrent writers share batches, each gets its own outcome."""

from __future__ import annotations

import threading

import pytest

from eventing.group_commit import GroupCommit


def test_items_queued_during_a_write_go_together_in_the_next_batch():
    batches: list[list[int]] = []
    gate = threading.Event()

    def write(items):
        batches.append(list(items))
        if items == [0]:
            gate.wait(10)  # the first batch is "writing" while the others queue up
        return [item * 10 for item in items]

    group = GroupCommit(write)
    results: dict[int, int] = {}
    first = threading.Thread(target=lambda: results.__setitem__(0, group.submit(0)))
    first.start()
    while not batches:
        threading.Event().wait(0.005)
    others = [threading.Thread(target=lambda n=n: results.__setitem__(n, group.submit(n))) for n in range(1, 9)]
    for thread in others:
        thread.start()
    while len(group._queue) < 8:
        threading.Event().wait(0.005)
    gate.set()
    for thread in [first, *others]:
        thread.join(10)
    assert batches[0] == [0] and sorted(batches[1]) == list(range(1, 9)) and len(batches) == 2
    assert results == {n: n * 10 for n in range(9)}


def test_each_caller_gets_its_own_exception_and_a_failed_batch_fails_everyone_in_it():
    group = GroupCommit(lambda items: [ValueError(f"bad {i}") if i < 0 else i for i in items])
    assert group.submit_many([1, 2]) == [1, 2]
    with pytest.raises(ValueError, match="bad -1"):
        group.submit(-1)

    def broken(items):
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        GroupCommit(broken).submit(1)
    with pytest.raises(RuntimeError, match="outcomes"):
        GroupCommit(lambda items: []).submit(1)


def test_max_batch_caps_a_write_and_the_rest_follow():
    batches: list[int] = []
    group = GroupCommit(lambda items: (batches.append(len(items)), list(items))[1], max_batch=3)
    assert group.submit_many(list(range(7))) == list(range(7))
    assert batches == [3, 3, 1]


def test_an_enqueued_item_goes_with_the_next_batch_or_a_flush():
    batches: list[list[str]] = []
    group = GroupCommit(lambda items: (batches.append(list(items)), [None] * len(items))[1])
    group.enqueue("offsets-1")
    assert batches == []  # nobody waited, nothing written yet
    group.submit("record")
    assert batches == [["offsets-1", "record"]]
    group.enqueue("offsets-2")
    group.flush()
    assert batches[-1] == ["offsets-2"]
    group.flush()  # nothing queued: nothing written
    assert len(batches) == 2
