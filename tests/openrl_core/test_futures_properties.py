"""Future state machine properties over random event sequences.

Two oracles: the transition table itself (every move the fold makes is in the table or is a
terminal state absorbing an event), and the lifecycle rules restated independently (only a
request starts a future; the first completed/failed/cancelled decides it for good; a start
moves a pending future to running).
"""

from typing import Optional

from hypothesis import given, settings
from hypothesis import strategies as st

from openrl_core.errors import ServerError
from openrl_core.futures import TERMINAL, TRANSITIONS, FutureState, Phase, evolve, is_terminal

ENDS = {
    Phase.COMPLETED: FutureState.COMPLETED,
    Phase.FAILED: FutureState.FAILED,
    Phase.CANCELLED: FutureState.CANCELLED,
}
phases = st.lists(st.sampled_from(list(Phase)), max_size=30)


def expected(state: Optional[FutureState], phase: Phase) -> Optional[FutureState]:
    """The lifecycle rules; None where the event is impossible (an emitter bug)."""
    if state is None:
        return FutureState.PENDING if phase is Phase.REQUESTED else None
    if state in (FutureState.COMPLETED, FutureState.FAILED, FutureState.CANCELLED):
        return state
    if phase is Phase.REQUESTED:
        return state  # a redelivered request
    if phase is Phase.STARTED:
        return FutureState.RUNNING
    return ENDS[phase]


@settings(max_examples=300)
@given(st.one_of(st.none(), st.sampled_from(list(FutureState))), phases)
def test_random_histories_follow_the_table_and_never_leave_a_terminal_state(state, history):
    first_end = state if state in TERMINAL else None
    for phase in history:
        want = expected(state, phase)
        try:
            after = evolve(state, phase)
        except ServerError:
            assert want is None and state not in TERMINAL and (state, phase) not in TRANSITIONS
            continue  # the store refuses the event; the future keeps its state
        assert after == want
        if state in TERMINAL:
            assert after is state
        else:
            assert TRANSITIONS[(state, phase)] is after
        if first_end is None and is_terminal(after):
            first_end = after
        state = after
    if first_end is not None:
        assert state is first_end  # the first result wins, whatever came after


@settings(max_examples=100)
@given(phases)
def test_redelivering_any_prefix_changes_nothing(history):
    """At-least-once delivery: replaying events already folded leaves the state where it was."""
    state = None
    folded = []
    for phase in [Phase.REQUESTED, *history]:
        try:
            state = evolve(state, phase)
        except ServerError:
            continue
        folded.append(phase)
    again = state
    for phase in folded:
        again = evolve(again, phase)
    assert again is state
