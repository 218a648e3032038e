"""The future state machine: a pure fold of request lifecycle events.

A future is born by a `…requested` event and ends in exactly one terminal state. Events
are delivered at least once and may arrive late, so a terminal future absorbs every later
event unchanged (the first result wins) instead of failing; any other move not in the table
is a bug in the emitter and raises.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

from openrl_core.errors import ServerError


class FutureState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Phase(str, Enum):
    REQUESTED = "requested"
    STARTED = "started"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset({FutureState.COMPLETED, FutureState.FAILED, FutureState.CANCELLED})

TRANSITIONS: dict[tuple[Optional[FutureState], Phase], FutureState] = {
    (None, Phase.REQUESTED): FutureState.PENDING,
    (FutureState.PENDING, Phase.REQUESTED): FutureState.PENDING,
    (FutureState.PENDING, Phase.STARTED): FutureState.RUNNING,
    (FutureState.PENDING, Phase.COMPLETED): FutureState.COMPLETED,
    (FutureState.PENDING, Phase.FAILED): FutureState.FAILED,
    (FutureState.PENDING, Phase.CANCELLED): FutureState.CANCELLED,
    (FutureState.RUNNING, Phase.REQUESTED): FutureState.RUNNING,
    (FutureState.RUNNING, Phase.STARTED): FutureState.RUNNING,
    (FutureState.RUNNING, Phase.COMPLETED): FutureState.COMPLETED,
    (FutureState.RUNNING, Phase.FAILED): FutureState.FAILED,
    (FutureState.RUNNING, Phase.CANCELLED): FutureState.CANCELLED,
}


def evolve(state: Optional[FutureState], phase: Phase) -> FutureState:
    if state in TERMINAL:
        return state  # type: ignore[return-value]
    try:
        return TRANSITIONS[(state, phase)]
    except KeyError:
        raise ServerError(f"a future in state {state} cannot take a {phase.value} event") from None


def is_terminal(state: FutureState) -> bool:
    return state in TERMINAL
