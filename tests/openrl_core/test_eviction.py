"""The release rule for idle runs, as a given/when/then table."""

from __future__ import annotations

import pytest

from openrl_core.eviction import Action, RunFacts, decide

AFTER = 600.0
QUIET = dict(idle_seconds=601.0, clean=True, busy=False, snapshot_in_flight=False, covered=False)


@pytest.mark.parametrize(
    "given, then",
    [
        ({}, Action.SNAPSHOT),  # idle, clean, requests applied since its last durable snapshot
        ({"covered": True}, Action.RELEASE),  # a durable snapshot holds all of it already
        ({"idle_seconds": 599.9}, Action.KEEP),  # not idle long enough
        ({"idle_seconds": 600.0, "covered": True}, Action.RELEASE),  # exactly the limit counts
        ({"clean": False}, Action.KEEP),  # gradients pending: a snapshot would lose them
        ({"clean": False, "covered": True}, Action.KEEP),
        ({"busy": True}, Action.KEEP),  # a request held by its gate or queued
        ({"busy": True, "covered": True}, Action.KEEP),
        ({"snapshot_in_flight": True}, Action.KEEP),  # wait until it is durable
        ({"snapshot_in_flight": True, "covered": True}, Action.KEEP),
    ],
)
def test_decide(given, then):
    assert decide(RunFacts(**{**QUIET, **given}), AFTER) is then


@pytest.mark.parametrize("after", [0.0, -1.0])
def test_zero_or_less_never_releases(after):
    assert decide(RunFacts(**{**QUIET, "idle_seconds": 1e9, "covered": True}), after) is Action.KEEP
