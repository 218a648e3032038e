"""What retrieve_future answers for a finished future: complete_metadata for a large result
when (and only when) the poll allows it, the payload again and again, and 410 for a sample
whose session finished before the sample did (never for training futures)."""

from __future__ import annotations

import time

import pytest

from functions.gateway import proto
from tests.functions.gateway.sampling_rig import MODEL, start

PROTO = {"Accept": "application/x-protobuf"}


@pytest.fixture
def rig(tmp_path, tiny_files):
    rig, close = start(tmp_path, metadata_only_threshold_bytes=40)
    yield rig
    close()


def settled(rig, request_id, **headers):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answer = rig.post(
            "/api/v1/retrieve_future", {"request_id": request_id, "allow_metadata_only": False}, **headers
        )
        if answer.status_code != 408:
            return answer
    raise AssertionError(f"{request_id} never settled")


def test_a_large_result_is_announced_by_size_then_sent(rig):
    big, small = rig.sample(seq_id=1), rig.sample(seq_id=2)
    rig.finish_sample(big, tokens=tuple(range(10, 30)))
    rig.finish_sample(small, tokens=(5,))
    payload = settled(rig, big, **PROTO).content
    assert len(payload) > 40 and payload == proto.encode_sample_response(
        {"sequences": [{"tokens": list(range(10, 30)), "logprobs": [-0.5] * 20, "stop_reason": "length"}]}
    )
    # the SDK's first poll allows metadata: only the size comes back ...
    first = rig.post("/api/v1/retrieve_future", {"request_id": big, "allow_metadata_only": True}, **PROTO)
    assert first.json() == {"status": "complete_metadata", "response_payload_size": len(payload)}
    # ... and its next poll (allow_metadata_only=false) gets the payload, never metadata again
    for _ in range(2):
        again = rig.post("/api/v1/retrieve_future", {"request_id": big, "allow_metadata_only": False}, **PROTO)
        assert again.headers["content-type"] == "application/x-protobuf" and again.content == payload
    # a result under the threshold is sent at once even when metadata is allowed
    direct = rig.post("/api/v1/retrieve_future", {"request_id": small, "allow_metadata_only": True}, **PROTO)
    assert direct.headers["content-type"] == "application/x-protobuf" and len(direct.content) <= 40
    # the size is of what this poll would get: the JSON rendering for a poll without protobuf
    as_json = settled(rig, big)
    meta = rig.post("/api/v1/retrieve_future", {"request_id": big, "allow_metadata_only": True}).json()
    assert meta["response_payload_size"] == len(as_json.content)


def test_failures_are_never_announced_by_size(rig):
    request_id = rig.sample()
    rig.finish_sample(request_id, failed=True)
    settled(rig, request_id)
    answer = rig.post("/api/v1/retrieve_future", {"request_id": request_id, "allow_metadata_only": True}, **PROTO)
    assert answer.json() == {"error": "boom", "category": "server"}


def test_a_sample_finished_before_its_session_stays_retrievable_any_later_one_is_gone(rig):
    done, pending, late = rig.sample(seq_id=1), rig.sample(seq_id=2), rig.sample(seq_id=3)
    rig.finish_sample(done)
    payload = settled(rig, done, **PROTO).content
    model = rig.post(
        "/api/v1/create_model",
        {"session_id": rig.session_id, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 4}},
    ).json()

    assert rig.post(f"/api/v1/sessions/{rig.session_id}/finish", {"reason": {"type": "success"}}).status_code == 200
    rig.finish_sample(late)  # completes after the session ended

    for _ in range(2):  # retrievable more than once, also after the session ended
        assert settled(rig, done, **PROTO).content == payload
    gone = rig.post("/api/v1/retrieve_future", {"request_id": pending}, **PROTO)
    assert gone.status_code == 410 and "finished before it completed" in gone.json()["detail"]
    time.sleep(0.3)
    assert rig.post("/api/v1/retrieve_future", {"request_id": late}, **PROTO).status_code == 410
    # a training future of the same finished session is never 410
    held = rig.post("/api/v1/retrieve_future", {"request_id": model["request_id"]})
    assert held.status_code == 408  # still pending (no trainer here): held, then try_again
