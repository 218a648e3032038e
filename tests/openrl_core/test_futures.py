"""The future state machine as given / when / then tables."""

import pytest

from openrl_core.errors import ServerError
from openrl_core.futures import TERMINAL, TRANSITIONS, FutureState, Phase, evolve

P, R, C, F, X = (
    FutureState.PENDING,
    FutureState.RUNNING,
    FutureState.COMPLETED,
    FutureState.FAILED,
    FutureState.CANCELLED,
)

CASES = [
    # given, when, then
    (None, Phase.REQUESTED, P),
    (P, Phase.STARTED, R),
    (P, Phase.COMPLETED, C),
    (P, Phase.FAILED, F),
    (R, Phase.COMPLETED, C),
    (R, Phase.FAILED, F),
    (R, Phase.CANCELLED, X),
    (P, Phase.REQUESTED, P),  # a redelivered request
    (R, Phase.STARTED, R),  # a redelivered start
    # a finished future absorbs late and repeated events: the first result wins
    (C, Phase.COMPLETED, C),
    (C, Phase.FAILED, C),
    (F, Phase.COMPLETED, F),
    (C, Phase.STARTED, C),
    (X, Phase.COMPLETED, X),
]


@pytest.mark.parametrize("given,when,then", CASES)
def test_transitions(given, when, then):
    assert evolve(given, when) == then


@pytest.mark.parametrize("when", [Phase.STARTED, Phase.COMPLETED, Phase.FAILED, Phase.CANCELLED])
def test_nothing_but_a_request_starts_a_future(when):
    with pytest.raises(ServerError):
        evolve(None, when)


def test_terminal_states_have_no_outgoing_edges_in_the_table():
    assert TERMINAL == {C, F, X}
    assert not [key for key in TRANSITIONS if key[0] in TERMINAL]


def test_a_fold_of_a_redelivered_history_ends_where_the_first_did():
    history = [Phase.REQUESTED, Phase.STARTED, Phase.REQUESTED, Phase.COMPLETED, Phase.FAILED, Phase.COMPLETED]
    state = None
    for phase in history:
        state = evolve(state, phase)
    assert state is C
