"""Per-step sampling throughput (openrl_core.sampling_rate) against independent computations:
hand-worked cases, and random runs recomputed by brute force (every sample checked against
every window; busy time as the count of covered unit cells on an integer grid)."""

from __future__ import annotations

import random

import pytest

from openrl_core.sampling_rate import SampleSpan, StepSampling, busy_seconds, per_step


def test_a_hand_worked_run():
    # Step 1 ends at t=10, step 2 at t=20, step 3 at t=30.
    ends = [(1, 10.0), (2, 20.0), (3, 30.0)]
    samples = [
        SampleSpan(1.0, 4.0, 30),  # step 1: two concurrent requests, 1-4 and 2-5 -> busy 4 s
        SampleSpan(2.0, 5.0, 10),
        SampleSpan(11.0, 12.0, 5),  # step 2: two apart, 11-12 and 14-16 -> busy 3 s
        SampleSpan(14.0, 16.0, 7),
        SampleSpan(18.0, 20.0, 4),  # completes exactly at step 2's end: step 2's
        SampleSpan(31.0, 33.0, 99),  # after the last step: no step's
    ]
    assert per_step(ends, samples) == [
        StepSampling(1, 2, 40, 4.0, 10.0),
        StepSampling(2, 3, 16, 5.0, 3.2),
        StepSampling(3, 0, 0, 0.0, None),  # no sampling in step 3's window
    ]


def test_busy_seconds_merges_overlaps_and_touching_intervals():
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0, 2), (1, 3), (3, 4), (10, 11)]) == 5.0
    assert busy_seconds([(5, 6), (0, 10)]) == 10.0  # one inside another, out of order
    assert busy_seconds([(3, 1)]) == 0.0  # a reversed interval is empty


def brute_force(ends: list[tuple[int, int]], samples: list[SampleSpan]) -> list[tuple[int, int, int, int]]:
    """(step, requests, tokens, busy seconds) by checking every sample against every window."""
    out, previous = [], None
    for step, end in ends:
        mine = [s for s in samples if (previous is None or s.completed > previous) and s.completed <= end]
        cells = {t for s in mine for t in range(int(s.taken), int(s.completed))}  # unit cells covered
        out.append((step, len(mine), sum(s.tokens for s in mine), len(cells)))
        previous = end
    return out


@pytest.mark.parametrize("seed", range(40))
def test_random_runs_match_brute_force(seed):
    rng = random.Random(seed)
    times = sorted(rng.sample(range(1, 400), rng.randint(1, 12)))
    ends = [(i + 1, t) for i, t in enumerate(times)]
    if rng.random() < 0.3 and len(ends) > 1:  # two steps ending at the same moment
        ends[1] = (2, ends[0][1])
    samples = []
    for _ in range(rng.randint(0, 40)):
        taken = rng.randint(0, 420)
        samples.append(SampleSpan(float(taken), float(taken + rng.randint(0, 30)), rng.randint(0, 64)))
    got = per_step([(s, float(t)) for s, t in ends], samples)
    assert [(g.step, g.requests, g.tokens, g.seconds) for g in got] == [
        tuple(map(float, b)) for b in brute_force(ends, samples)
    ]
    for g in got:
        assert g.tokens_per_second == (None if g.seconds == 0 else pytest.approx(g.tokens / g.seconds, abs=1e-3))
