"""Seq ordering: given arrivals, then the order in which requests are released."""

import pytest

from openrl_core.seqgate import SeqGate


def released(gate, arrivals):
    out = []
    for seq in arrivals:
        out += [s for s, _ in gate.offer(seq, f"r{seq}").ready]
    return out


@pytest.mark.parametrize(
    "arrivals,order",
    [
        ([1, 2, 3], [1, 2, 3]),
        ([2, 1, 3], [1, 2, 3]),  # the SDK sends a batch's first chunk last
        ([3, 2, 1], [1, 2, 3]),
        ([1, 3, 4, 2, 5], [1, 2, 3, 4, 5]),
        ([2, 3], []),  # nothing passes a gap
    ],
)
def test_release_order(arrivals, order):
    assert released(SeqGate(), arrivals) == order


def test_duplicates_are_reported_and_not_released_twice():
    gate = SeqGate()
    assert [s for s, _ in gate.offer(1, "a").ready] == [1]
    assert gate.offer(1, "again").duplicate
    gate.offer(3, "c")
    assert gate.offer(3, "c-again").duplicate  # held, not yet applied: still a duplicate
    assert [s for s, _ in gate.offer(2, "b").ready] == [2, 3]


def test_a_skipped_seq_unblocks_the_ones_behind_it():
    gate = SeqGate()
    gate.offer(1, "a")
    assert gate.offer(3, "c").ready == []
    assert gate.waiting_for == 2
    assert gate.skip(2) == [(3, "c")]
    assert gate.waiting_for is None
    assert gate.skip(2) == []  # idempotent
    assert gate.offer(2, "late").duplicate


def test_skip_ahead_of_time():
    gate = SeqGate()
    assert gate.skip(2) == []
    assert [s for s, _ in gate.offer(1, "a").ready] == [1]
    assert [s for s, _ in gate.offer(3, "c").ready] == [3]


def test_barrier_semantics_no_forward_backward_passes_an_optim_step():
    # seq 3 is an optim_step; 4 (a forward_backward) arrives first and must wait for it.
    gate = SeqGate()
    order = released(gate, [1, 2, 4, 3])
    assert order.index(3) < order.index(4)
