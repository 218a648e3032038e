"""Sampling throughput per training step: a pure fold of a run's finished sample requests
into the windows between its optim_steps.

Step N's window is (end of step N-1, end of step N]; step 1's starts at the beginning of
time. A sample request belongs to the window its completion falls in, so in an RL loop step
N holds the rollouts that step N trained on. For each step: the requests, the tokens they
generated, and their `seconds`, the length of the union of their [taken, completed]
intervals, i.e. the time at least one of them was in flight. A group sampled concurrently
is thus counted once, not once per request, and `tokens_per_second` (tokens over those
seconds) is the throughput the run saw; it is None for a step with no sampling time.
Samples completed after the last step belong to no step yet. Times are seconds on any one
clock (the callers use Unix time); nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(frozen=True)
class SampleSpan:
    """One finished sample request: when it was taken, when it completed, tokens generated."""

    taken: float
    completed: float
    tokens: int


@dataclass(frozen=True)
class StepSampling:
    step: int
    requests: int
    tokens: int
    seconds: float
    tokens_per_second: Optional[float]


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of closed intervals (start, end); an interval with end < start is empty."""
    total, current_start = 0.0, 0.0  # current_start: set whenever current_end is
    current_end: Optional[float] = None
    for start, end in sorted((s, e) for s, e in intervals if e >= s):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def per_step(step_ends: list[tuple[int, float]], samples: Iterable[SampleSpan]) -> list[StepSampling]:
    """One entry per step of `step_ends` ((step, completed time), in step order, times not
    decreasing), with the samples whose completion falls in that step's window."""
    ends = [end for _, end in step_ends]
    buckets: list[list[SampleSpan]] = [[] for _ in step_ends]
    for sample in samples:
        # The first step whose end is at or after the completion: windows are open on the left.
        index = bisect.bisect_left(ends, sample.completed)
        if index < len(buckets):
            buckets[index].append(sample)
    out = []
    for (step, _), bucket in zip(step_ends, buckets):
        tokens = sum(s.tokens for s in bucket)
        seconds = busy_seconds((s.taken, s.completed) for s in bucket)
        rate = tokens / seconds if seconds > 0 else None
        out.append(StepSampling(step, len(bucket), tokens, round(seconds, 6), None if rate is None else round(rate, 3)))
    return out
