"""Forking a run at a step: which snapshot to start from and which logged requests to re-apply.

A run's state right after its N-th completed `optim_step` is a pure function of its history:
its creation, then every training request whose future completed, applied in `seq_id` order
(the order the trainer applied them). `plan` picks the cheapest way to rebuild it: the
latest snapshot taken at or before that step (a snapshot is taken right after an
`optim_step`, so it holds exactly the state at that step), else the run's creation, plus the
requests after it up to and including that `optim_step`. Only requests that change state are
re-applied: training `forward_backward` calls (not `forward_only` ones), `optim_step` and an
in-place `load_weights`; saves change nothing.

Steps count completed `optim_step` futures only, in seq order, as the per-step metrics do:
a failed step, or one whose run was cancelled before it completed, is no step. Step 0 is
the state right after creation (fresh initialisation, or the checkpoint the run was
created from). Every check raises a typed error, so the gateway can answer it as a 4xx.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from openrl_core.errors import Conflict, InvalidRequest

# What a logged request is, for planning: the verbs that change a run's state.
FORWARD_BACKWARD, OPTIM_STEP, LOAD_WEIGHTS, OTHER = "forward_backward", "optim_step", "load_weights", "other"
COMPLETED, UNFINISHED, ENDED = "completed", "unfinished", "ended"  # ended: failed or cancelled


@dataclass(frozen=True)
class Logged:
    """One of the run's sequenced requests as the store holds it."""

    seq_id: int
    verb: str  # FORWARD_BACKWARD, OPTIM_STEP, LOAD_WEIGHTS or OTHER
    outcome: str  # COMPLETED, UNFINISHED or ENDED
    forward_only: bool = False

    @property
    def changes_state(self) -> bool:
        if self.verb == FORWARD_BACKWARD:
            return not self.forward_only
        return self.verb in (OPTIM_STEP, LOAD_WEIGHTS)


@dataclass(frozen=True)
class Plan:
    step: int
    through_seq: int  # the seq_id of the N-th completed optim_step; 0 for step 0
    snapshot_next_seq: Optional[int]  # the snapshot to start from (by its next_seq), None: creation
    snapshot_step: int  # the step that snapshot holds (0 when starting from creation)
    replay: tuple[int, ...]  # seq_ids to re-apply on top, in order
    completed_steps: int  # how many steps the run has completed in all


def completed_steps(history: Sequence[Logged]) -> list[int]:
    """The seq_ids of the run's completed optim_steps, in order: step k is the k-th one."""
    return sorted(entry.seq_id for entry in history if entry.verb == OPTIM_STEP and entry.outcome == COMPLETED)


def plan(history: Sequence[Logged], snapshots: Sequence[int], step: int) -> Plan:
    """`snapshots` are the `next_seq` of the run's snapshots whose files are all still stored.

    Raises InvalidRequest for a step out of range, Conflict when a request before the step
    has not finished yet (the history up to it is not settled).
    """
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidRequest(f"step must be an integer, got {step!r}")
    steps = completed_steps(history)
    if step < 0 or step > len(steps):
        raise InvalidRequest(f"step must be between 0 and {len(steps)} (the run's completed optim_steps), got {step}")
    through = steps[step - 1] if step else 0
    unsettled = sorted(entry.seq_id for entry in history if entry.seq_id <= through and entry.outcome == UNFINISHED)
    if unsettled:
        raise Conflict(f"request seq_id {unsettled[0]} before step {step} has not finished yet; fork again once it has")
    # A snapshot counts only if it sits right after a completed step at or before the target:
    # then it holds exactly that step's state (a snapshot after a step whose future did not
    # complete, say a run cancelled meanwhile, is not part of the history the steps count).
    step_of = {seq_id + 1: index + 1 for index, seq_id in enumerate(steps[:step])}
    usable = [next_seq for next_seq in snapshots if next_seq in step_of]
    start = max(usable) if usable else None
    after = start if start is not None else 1
    replay = tuple(
        entry.seq_id
        for entry in sorted(history, key=lambda e: e.seq_id)
        if after <= entry.seq_id <= through and entry.outcome == COMPLETED and entry.changes_state
    )
    return Plan(
        step=step,
        through_seq=through,
        snapshot_next_seq=start,
        snapshot_step=step_of[start] if start is not None else 0,
        replay=replay,
        completed_steps=len(steps),
    )
