"""The idleness rule: housekeeping only after the whole process has been quiet a moment."""

from __future__ import annotations

import pytest

from openrl_core.idleness import Idleness


def test_nothing_is_due_before_any_work_ran():
    assert not Idleness().due(now=100.0, quiet=1.0)


def test_due_once_quiet_long_enough_after_work_then_not_again_until_more_work():
    idle = Idleness()
    idle.begin()
    idle.end(now=10.0)
    assert not idle.due(now=10.5, quiet=1.0)
    assert idle.due(now=11.0, quiet=1.0)
    idle.done()
    assert not idle.due(now=20.0, quiet=1.0)  # nothing ran since
    idle.begin()
    idle.end(now=21.0)
    assert idle.due(now=22.0, quiet=1.0)


def test_never_due_while_any_worker_is_working():
    idle = Idleness()
    idle.begin()  # the trainer
    idle.begin()  # the sampler
    idle.end(now=1.0)  # the sampler ends; the trainer still works
    assert not idle.due(now=50.0, quiet=1.0)
    idle.end(now=60.0)
    assert not idle.due(now=60.5, quiet=1.0)  # counted from the last one to end
    assert idle.due(now=61.0, quiet=1.0)


def test_a_zero_quiet_is_due_as_soon_as_work_ends():
    idle = Idleness()
    idle.begin()
    assert not idle.due(now=5.0, quiet=0.0)
    idle.end(now=5.0)
    assert idle.due(now=5.0, quiet=0.0)


def test_end_without_begin_is_a_bug():
    with pytest.raises(ValueError):
        Idleness().end(now=1.0)
