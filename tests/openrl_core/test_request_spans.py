"""One request's spans from its folded events, as given/when/then tables (openrl_core/request_spans.py)."""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone

import pytest

from openrl_core import request_spans as rs
from openrl_core.session_trace import Request

T0 = datetime(2026, 12, 7, 12, 0, 0, tzinfo=timezone.utc)


def at(ms: float) -> datetime:
    return T0 + timedelta(milliseconds=ms)


def request(**phases) -> Request:
    fields = {"worker": "/openrl/trainer", "lease_id": 7, "outcome": "completed", **phases}
    return Request("req-1", "model-a", "training", "optim_step", **fields)


def shape(spans):
    return [(s.name, s.parent_id is None, s.start, s.end) for s in spans]


@pytest.mark.parametrize(
    "given, stored, expected",
    [
        # The trainer: requested, a recorded start, finished; the root reaches the store.
        (
            dict(requested=at(0), started=at(5), finished=at(50)),
            at(53),
            [("optim_step", True, at(0), at(53)), (rs.QUEUED, False, at(0), at(5)),
             (rs.RUN, False, at(5), at(50)), (rs.STORE, False, at(50), at(53))],
        ),
        # The sampler records no start: queued and run are one child.
        (
            dict(requested=at(0), finished=at(20)),
            at(21),
            [("optim_step", True, at(0), at(21)), (rs.QUEUED_AND_RUN, False, at(0), at(20)),
             (rs.STORE, False, at(20), at(21))],
        ),
        # No request stored under the key (a start and a finish only): no queued child.
        (
            dict(started=at(5), finished=at(9)),
            at(10),
            [("optim_step", True, at(5), at(10)), (rs.RUN, False, at(5), at(9)), (rs.STORE, False, at(9), at(10))],
        ),
        # The projector's clock behind the worker's: the store span is empty, never negative.
        (
            dict(requested=at(0), started=at(1), finished=at(9)),
            at(8),
            [("optim_step", True, at(0), at(9)), (rs.QUEUED, False, at(0), at(1)),
             (rs.RUN, False, at(1), at(9)), (rs.STORE, False, at(9), at(9))],
        ),
        # Not finished, or a record that was never requested nor started: no trace.
        (dict(requested=at(0), started=at(1), outcome=None), at(2), []),
        (dict(finished=at(3)), at(4), []),
    ],
)  # fmt: skip
def test_spans_of(given, stored, expected):
    assert shape(rs.spans_of(request(**given), "alice", stored)) == expected


def test_children_hang_off_the_root_and_carry_the_requests_attributes():
    spans = rs.spans_of(request(requested=at(0), started=at(5), finished=at(50)), "alice", at(53))
    root, children = spans[0], spans[1:]
    assert {s.parent_id for s in children} == {root.span_id}
    assert {s.trace_id for s in spans} == {root.trace_id}
    assert len({s.span_id for s in spans}) == 4
    assert all(s.attributes == root.attributes for s in children)
    assert root.attributes == {
        "openrl.tenant": "alice", "openrl.model_id": "model-a", "openrl.request_id": "req-1",
        "openrl.family": "training", "openrl.outcome": "completed", "openrl.worker": "/openrl/trainer",
        "openrl.lease_id": 7,
    }  # fmt: skip
    assert root.error is None


def test_a_failed_request_marks_its_root_only():
    spans = rs.spans_of(request(requested=at(0), finished=at(2), outcome="failed"), "alice", at(3), "user: bad")
    assert spans[0].error == "user: bad" and spans[0].attributes["openrl.outcome"] == "failed"
    assert all(s.error is None for s in spans[1:])


def test_ids_are_derived_from_the_request_id_alone():
    # Independently of the module: SHA-256 over the documented preimage.
    digest = hashlib.sha256("openrl.request_spans.v1\0trace\0req-1".encode()).digest()
    assert rs.trace_id_of("req-1") == int.from_bytes(digest[:16], "big")
    first = rs.spans_of(request(requested=at(0), finished=at(2)), "alice", at(3))
    again = rs.spans_of(request(requested=at(0), finished=at(2)), "alice", at(9))  # a redelivery, stored later
    assert [(s.trace_id, s.span_id) for s in first] == [(s.trace_id, s.span_id) for s in again]
    assert rs.trace_id_of("req-2") != rs.trace_id_of("req-1")
    assert 0 < rs.trace_id_of("req-1") < 2**128 and 0 < rs.span_id_of("req-1", "x") < 2**64
