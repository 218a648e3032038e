"""Seq gate properties: any arrival order releases a model's requests in order, exactly once.

The oracle is written from the gate's contract, not from its code: the first offer or skip
of a seq_id decides it; a seq_id is released once every seq_id from the start up to it has
been decided; it is released with the item of its first offer (a skip releases nothing);
every later offer of it, and every offer below the start, is a duplicate.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from openrl_core.seqgate import SeqGate

OFFER, SKIP = "offer", "skip"


@st.composite
def histories(draw):
    """A start seq, and operations that decide 1..n in any order, with redeliveries, skips,
    stale seq_ids below the start and seq_ids past a gap mixed in anywhere."""
    start = draw(st.integers(1, 4))
    n = draw(st.integers(0, 25))
    decided = draw(st.permutations(range(start, start + n)))
    extra = draw(st.lists(st.integers(0, start + n + 3), max_size=15))
    seqs = list(decided)
    for seq in extra:
        seqs.insert(draw(st.integers(0, len(seqs))), seq)
    ops = [(draw(st.sampled_from([OFFER, OFFER, OFFER, SKIP])), seq, f"item-{i}") for i, seq in enumerate(seqs)]
    return start, ops


@settings(max_examples=300)
@given(histories())
def test_any_arrival_order_releases_in_order_exactly_once(history):
    start, ops = history
    gate = SeqGate(next_seq=start)
    first: dict[int, tuple[str, str]] = {}  # seq -> (kind, item) of its first operation
    released_upto = start - 1
    out: list[tuple[int, str]] = []
    for kind, seq, item in ops:
        stale_or_seen = seq < start or seq in first
        if kind == OFFER:
            offer = gate.offer(seq, item)
            assert offer.duplicate == stale_or_seen
            ready = offer.ready
        else:
            ready = gate.skip(seq)
        if not stale_or_seen:
            first[seq] = (kind, item)
        # oracle: everything decided without a gap from the start is out now
        expected = []
        while released_upto + 1 in first:
            released_upto += 1
            first_kind, first_item = first[released_upto]
            if first_kind == OFFER:
                expected.append((released_upto, first_item))
        assert ready == expected
        out += ready
        held = sorted(s for s in first if s > released_upto)
        assert gate.held == held
        assert gate.waiting_for == (released_upto + 1 if held else None)
        assert gate.next_seq == released_upto + 1

    seqs = [seq for seq, _ in out]
    assert seqs == sorted(set(seqs))  # in order, never twice
    assert all(first[seq] == (OFFER, item) for seq, item in out)  # the first offer's item
