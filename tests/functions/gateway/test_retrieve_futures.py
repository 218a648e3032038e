"""retrieve_futures: a sampling session's completions after a cursor, long-polled and woken by
completions (also of samples sent after the poll began), each request reported once, only to
the clone that sent it, with the size of the payload retrieve_future will then send."""

from __future__ import annotations

import threading
import time

import pytest

from functions.gateway import proto
from openrl_core.wire.futures import CLONE_SEQ_STRIDE
from tests.functions.gateway.sampling_rig import BOB, start


@pytest.fixture
def rig(tmp_path, tiny_files):
    rig, close = start(tmp_path)
    yield rig
    close()


def poll(rig, cursor=0, timeout=None, clone=0, key=None, sampling_session_id=None):
    body = {
        "target": {
            "type": "sampling_session",
            "sampling_session_id": sampling_session_id or rig.sampling_session_id,
            "cloned_sampler_id": clone,
        },
        "prev_cursor": cursor,
        "retrieved_request_ids": [],
    }
    if timeout is not None:
        body["timeout"] = timeout
    return rig.post("/api/v1/retrieve_futures", body, **({"key": key} if key else {}))


def wait_for_completions(rig, cursor=0, clone=0, want=1):
    """Polls with timeout 0 until `want` completions are in (the projector is a thread)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answer = poll(rig, cursor, timeout=0, clone=clone).json()
        if len(answer["completions"]) >= want:
            return answer
        time.sleep(0.05)
    raise AssertionError("completions never arrived")


def test_timeout_zero_answers_at_once_and_keeps_the_cursor(rig):
    rig.sample()
    started = time.monotonic()
    answer = poll(rig, cursor=0, timeout=0)
    assert time.monotonic() - started < 1.0
    assert answer.status_code == 200 and answer.json() == {"completions": [], "cursor": 0}


def test_a_held_poll_is_woken_by_the_completion_and_reports_the_payload_size(rig):
    rig.runtime.settings.long_poll_seconds = 20
    request_id = rig.sample()
    threading.Timer(0.3, rig.finish_sample, (request_id, (5, 6, 7))).start()
    started = time.monotonic()
    answer = poll(rig).json()
    assert 0.3 <= time.monotonic() - started < 3
    [completion] = answer["completions"]
    assert completion["state"] == "finished" and completion["request_id"] == request_id
    # exactly the bytes retrieve_future then sends for a protobuf poll
    payload = rig.post("/api/v1/retrieve_future", {"request_id": request_id}, Accept="application/x-protobuf").content
    assert completion["response_payload_uncompressed_size"] == len(payload)
    assert answer["cursor"] > 0
    # seen: the next poll from that cursor has nothing, and answers at once when told to
    assert poll(rig, cursor=answer["cursor"], timeout=0).json() == {"completions": [], "cursor": answer["cursor"]}


def test_an_unfinished_poll_is_held_for_the_window_then_answers_empty(rig):
    rig.sample()
    started = time.monotonic()
    answer = poll(rig, cursor=0)
    assert 1.4 <= time.monotonic() - started < 5
    assert answer.json() == {"completions": [], "cursor": 0}


def test_a_sample_sent_after_the_poll_began_also_wakes_it(rig):
    rig.runtime.settings.long_poll_seconds = 20
    rig.sample(seq_id=1)  # pending all along: the poll starts out watching only this one
    results = {}

    def held_poll():
        started = time.monotonic()
        results["answer"] = poll(rig).json()
        results["waited"] = time.monotonic() - started

    thread = threading.Thread(target=held_poll)
    thread.start()
    time.sleep(0.4)
    late = rig.sample(seq_id=2)
    time.sleep(0.2)
    rig.finish_sample(late)
    thread.join(timeout=25)
    assert [c["request_id"] for c in results["answer"]["completions"]] == [late]
    assert results["waited"] < 5


def test_failures_are_reported_and_a_redelivered_completion_only_once(rig):
    failed, done = rig.sample(seq_id=1), rig.sample(seq_id=2)
    rig.finish_sample(failed, failed=True)
    rig.finish_sample(done)
    first = wait_for_completions(rig, want=2)
    assert first["completions"] == [
        {"state": "failed", "request_id": failed},
        {"state": "finished", "request_id": done, "response_payload_uncompressed_size": len(proto.encode_sample_response(
            {"sequences": [{"tokens": [7, 8], "logprobs": [-0.5, -0.5], "stop_reason": "length"}]}))},
    ]  # fmt: skip
    # at-least-once delivery: the same completion again (a new event id) is not news
    rig.finish_sample(done, tokens=(9,))
    time.sleep(0.5)
    later = poll(rig, cursor=first["cursor"], timeout=0).json()
    assert later["completions"] == [] and later["cursor"] > first["cursor"]
    # from the beginning, each request still appears once
    again = poll(rig, cursor=0, timeout=0).json()
    assert sorted(c["request_id"] for c in again["completions"]) == sorted([failed, done])


def test_each_clone_hears_only_its_own_samples(rig):
    mine, theirs = rig.sample(seq_id=3), rig.sample(seq_id=CLONE_SEQ_STRIDE + 3)
    rig.finish_sample(theirs)
    rig.finish_sample(mine)
    assert [c["request_id"] for c in wait_for_completions(rig, clone=1)["completions"]] == [theirs]
    original = wait_for_completions(rig, clone=0)
    assert [c["request_id"] for c in original["completions"]] == [mine]
    # the other clone's completion was read past: the cursor covers both
    assert poll(rig, cursor=original["cursor"], timeout=0).json()["completions"] == []


def test_another_tenants_or_an_unknown_sampling_session_is_not_found(rig):
    assert poll(rig, timeout=0, key=BOB).status_code == 404
    answer = poll(rig, timeout=0, sampling_session_id="nope:sample:0")
    assert answer.status_code == 404 and "nope:sample:0" in answer.json()["detail"]


def test_a_full_page_of_other_clones_completions_is_read_past_at_once(rig, monkeypatch):
    from functions.gateway.routes import futures

    monkeypatch.setattr(futures, "MAX_COMPLETIONS", 1)
    theirs = [rig.sample(seq_id=1), rig.sample(seq_id=2)]
    mine = rig.sample(seq_id=CLONE_SEQ_STRIDE + 1)
    for request_id in (*theirs, mine):
        rig.finish_sample(request_id)
    for request_id in (*theirs, mine):  # all three stored
        while rig.post("/api/v1/retrieve_future", {"request_id": request_id}).status_code != 200:
            pass
    rig.runtime.settings.long_poll_seconds = 20
    started = time.monotonic()
    answer = poll(rig, clone=1).json()
    assert [c["request_id"] for c in answer["completions"]] == [mine]
    assert time.monotonic() - started < 5  # not held for the window between pages
