"""The fork plan as given/when/then tables: a run's logged requests and snapshots, a step,
and which snapshot the rebuild starts from and which requests it re-applies."""

from __future__ import annotations

import pytest

from openrl_core import forking
from openrl_core.errors import Conflict, InvalidRequest
from openrl_core.forking import COMPLETED, ENDED, FORWARD_BACKWARD, LOAD_WEIGHTS, OPTIM_STEP, OTHER, UNFINISHED, Logged


def fb(seq, outcome=COMPLETED, forward_only=False):
    return Logged(seq, FORWARD_BACKWARD, outcome, forward_only)


def step(seq, outcome=COMPLETED):
    return Logged(seq, OPTIM_STEP, outcome)


# fb/step pairs: steps 1, 2, 3 at seq 2, 4, 6; a save (seq 7) and step 4 at seq 9.
RUN = [fb(1), step(2), fb(3), step(4), fb(5), step(6), Logged(7, OTHER, COMPLETED), fb(8), step(9)]


@pytest.mark.parametrize(
    "history, snapshots, at, start, snapshot_step, replay",
    [
        (RUN, [], 0, None, 0, ()),  # step 0: the run as created, nothing re-applied
        (RUN, [], 2, None, 0, (1, 2, 3, 4)),  # no snapshot: from creation
        (RUN, [5], 2, 5, 2, ()),  # a snapshot right at the step: nothing to replay
        (RUN, [3, 5], 3, 5, 2, (5, 6)),  # the latest snapshot at or before the step
        (RUN, [3, 7], 2, 3, 1, (3, 4)),  # a snapshot after the step is of no use
        (RUN, [3], 4, 3, 1, (3, 4, 5, 6, 8, 9)),  # saves change nothing: not re-applied
        (RUN, [4], 2, None, 0, (1, 2, 3, 4)),  # next_seq 4 follows no completed step: not a step's state
        # failed and forward-only requests changed nothing; a failed optim_step is no step
        ([fb(1), fb(2, ENDED), fb(3, forward_only=True), step(4, ENDED), fb(5), step(6)], [], 1, None, 0, (1, 5, 6)),
        (
            [fb(1), Logged(2, LOAD_WEIGHTS, COMPLETED), step(3)],
            [],
            1,
            None,
            0,
            (1, 2, 3),
        ),  # an in-place load is re-applied
        # requests after the step may still be running: they are not part of it
        (RUN[:4] + [fb(5, UNFINISHED)], [], 2, None, 0, (1, 2, 3, 4)),
    ],
)
def test_plan(history, snapshots, at, start, snapshot_step, replay):
    plan = forking.plan(history, snapshots, at)
    assert (plan.snapshot_next_seq, plan.snapshot_step, plan.replay) == (start, snapshot_step, replay)
    assert plan.step == at and plan.through_seq == ([0] + forking.completed_steps(history))[at]


def test_a_step_past_the_completed_ones_or_below_zero_is_refused_with_the_range():
    for bad in (-1, 5):
        with pytest.raises(InvalidRequest, match=r"step must be between 0 and 4 .*got " + str(bad)):
            forking.plan(RUN, [], bad)
    with pytest.raises(InvalidRequest, match="integer"):
        forking.plan(RUN, [], True)
    assert forking.plan([fb(1), step(2, ENDED)], [], 0).completed_steps == 0


def test_a_request_before_the_step_that_has_not_finished_is_a_conflict():
    with pytest.raises(Conflict, match="seq_id 1 before step 1 has not finished"):
        forking.plan([fb(1, UNFINISHED), step(2)], [], 1)
