"""Which idle runs a trainer lets go of, and how: keep, snapshot first, or release.

A trainer holds every run it has served in memory (a LoRA adapter with its gradients and two
Adam moments, or a full run's own weights and optimizer: four copies of the model), and a
shared service sees runs start every day and most of them never come back. Parking moves a
run to host memory, which still grows with every run ever served. So a run that has sent
nothing for a while is released, and its next request (if one ever comes) restores it from
its latest snapshot, exactly as a replacement trainer does in recovery by replay: on CPU the
result is bitwise the state it had.

That is only sound when a durable snapshot covers every request the run has applied, and a
snapshot holds weights and optimizer state, not accumulated gradients. So a run is released
only at a clean point (no `forward_backward` since its last `optim_step` or weight load),
with nothing held back by its seq gate or queued for a turn; if requests were applied since
its latest durable snapshot, one is taken first and the run is released once that snapshot
is durable. A request arriving meanwhile makes the run active again, and it stays.

Pure: the caller passes the facts in (times as numbers) and carries the decision out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Action(str, Enum):
    KEEP = "keep"
    SNAPSHOT = "snapshot"  # take a snapshot of everything applied; release once it is durable
    RELEASE = "release"  # a durable snapshot covers everything applied: drop the state now


@dataclass(frozen=True)
class RunFacts:
    idle_seconds: float  # since the run's last request ran
    clean: bool  # no gradients accumulated since its last optim_step (or weight load)
    busy: bool  # requests held by its seq gate, or queued for a turn
    snapshot_in_flight: bool  # a snapshot of it is being written
    covered: bool  # its latest durable snapshot covers every request it applied


def decide(run: RunFacts, release_after_seconds: float) -> Action:
    """`release_after_seconds` <= 0: runs are never released."""
    if release_after_seconds <= 0 or run.idle_seconds < release_after_seconds:
        return Action.KEEP
    if run.busy or not run.clean or run.snapshot_in_flight:
        return Action.KEEP  # not at a point a snapshot can hold; look again later
    return Action.RELEASE if run.covered else Action.SNAPSHOT
