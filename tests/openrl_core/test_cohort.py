"""The cohort rule: wait for the members active lately that are missing, never alone."""

from __future__ import annotations

import pytest

from openrl_core.cohort import Cohort


def test_a_cohort_of_one_never_waits():
    cohort = Cohort(active_seconds=10)
    cohort.saw("run-a", now=0.0)
    assert cohort.missing({"run-a"}, now=1.0) == set()
    assert not cohort.waits({"run-a"}, now=1.0, deadline=5.0)


@pytest.mark.parametrize(
    "present, now, deadline, waits",
    [
        ({"a"}, 1.0, 2.0, True),  # b and c active, not here yet, time left
        ({"a", "b"}, 1.0, 2.0, True),  # c still missing
        ({"a", "b", "c"}, 1.0, 2.0, False),  # everyone here: stop at once
        ({"a"}, 2.0, 2.0, False),  # the deadline passed: stop anyway
        (set(), 1.0, 2.0, True),  # nothing yet but others are active
    ],
)
def test_a_batch_waits_for_missing_members_until_its_deadline(present, now, deadline, waits):
    cohort = Cohort(active_seconds=10)
    for member in ("a", "b", "c"):
        cohort.saw(member, now=0.5)
    assert cohort.waits(present, now, deadline) is waits


def test_members_quiet_for_longer_than_active_seconds_are_no_longer_waited_for():
    cohort = Cohort(active_seconds=10)
    cohort.saw("a", now=0.0)
    cohort.saw("b", now=5.0)
    assert cohort.missing({"b"}, now=9.0) == {"a"}
    assert cohort.missing({"b"}, now=10.5) == set()  # a went quiet: b is alone again
    assert cohort.active(now=10.5) == {"b"}
    cohort.forget("b")
    assert cohort.active(now=10.5) == set()


def test_active_seconds_must_be_positive():
    with pytest.raises(ValueError):
        Cohort(active_seconds=0)


def test_a_member_waited_for_in_vain_is_not_waited_for_again_until_it_sends():
    cohort = Cohort(active_seconds=10)
    cohort.saw("ended", now=0.0)  # a run that has finished, still within active_seconds
    cohort.saw("a", now=1.0)
    assert cohort.waits({"a"}, now=1.0, deadline=1.1)
    assert not cohort.waits({"a"}, now=1.1, deadline=1.1)  # the deadline passed: it is late
    assert cohort.missing({"a"}, now=2.0) == set()  # so the next batch does not wait for it
    assert not cohort.waits({"a"}, now=2.0, deadline=2.1)
    assert cohort.expected(now=2.0) == {"a"}
    cohort.saw("ended", now=3.0)  # it sends again: waited for as before
    assert cohort.missing({"a"}, now=3.5) == {"ended"}
    assert cohort.expected(now=3.5) == {"a", "ended"}


def test_only_the_members_still_missing_at_the_deadline_become_late():
    cohort = Cohort(active_seconds=10)
    for member in ("a", "b", "c"):
        cohort.saw(member, now=0.0)
    assert not cohort.waits({"a", "b"}, now=1.0, deadline=1.0)
    assert cohort.missing({"a"}, now=1.5) == {"b"}  # b came in time; only c is late
    assert cohort.waits({"a"}, now=1.5, deadline=2.0)
