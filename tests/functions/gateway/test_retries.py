"""Retries over HTTP: the SDK resends a submission with the same body (and seq_id) under a new
idempotency key. The same body gets the first future back and stores nothing new; another
body under a used seq_id is a 409 that says so."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from functions.gateway.app import create_app
from functions.runtime import Runtime
from openrl_core.events import training as te
from openrl_core.events.sampling import SAMPLE
from openrl_core.settings import Settings
from tests.functions.gateway.test_bad_input import PROTO, fb_body
from tests.functions.gateway.test_legacy_json import json_body

KEY = "tml-retries"
MODEL = "openrl/tiny-qwen3"


@pytest.fixture
def api(tmp_path, tiny_files):
    runtime = Runtime(Settings(data_dir=tmp_path, models=[MODEL], api_keys=[f"alice={KEY}"]))
    with TestClient(create_app(runtime.gateway_context())) as client:
        client.headers["X-API-Key"] = KEY
        session = client.post("/api/v1/create_session", json={}).json()["session_id"]
        body = {"session_id": session, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 4}}
        model_id = client.post("/api/v1/create_model", json=body).json()["model_id"]
        yield client, runtime, session, model_id
    runtime.close()


def count(runtime, type_):
    return sum(1 for _position, event in runtime.store.iterate() if event.type == type_)


def resend(client, path, **kwargs):
    """Twice, each with its own idempotency key, as the SDK's holder-level retry does."""
    headers = kwargs.pop("headers", {})
    return tuple(
        client.post(path, headers={**headers, "X-Idempotency-Key": f"stainless-python-retry-{n}"}, **kwargs)
        for n in (1, 2)
    )


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
def test_a_resent_forward_backward_gets_its_first_future_and_another_body_a_409(api, encoding):
    client, runtime, _session, model_id = api
    if encoding == "protobuf":
        same, other = (
            dict(content=fb_body(model_id, seq_id=1), headers=PROTO),
            dict(content=fb_body(model_id, seq_id=1, weights=(1.0, 0.0, 1.0)), headers=PROTO),
        )
    else:
        same, other = dict(json=json_body(model_id, 1)), dict(json=json_body(model_id, 1, loss_fn_config={}))
    first, second = resend(client, "/api/v1/forward_backward", **same)
    assert first.status_code == second.status_code == 200
    assert second.json() == first.json()
    assert count(runtime, te.FORWARD_BACKWARD["requested"]) == 1
    conflict = client.post("/api/v1/forward_backward", **other)
    assert conflict.status_code == 409 and "different body" in conflict.json()["detail"]
    assert count(runtime, te.FORWARD_BACKWARD["requested"]) == 1


def test_a_resent_optim_step_and_a_resent_sample(api):
    client, runtime, session, model_id = api
    first, second = resend(
        client, "/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.01}}
    )
    assert second.json() == first.json() and count(runtime, te.OPTIM_STEP["requested"]) == 1
    conflict = client.post(
        "/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.02}}
    )
    assert conflict.status_code == 409

    sampler = client.post(
        "/api/v1/create_sampling_session",
        json={"session_id": session, "sampling_session_seq_id": 0, "base_model": MODEL},
    ).json()
    sample = {"sampling_session_id": sampler["sampling_session_id"], "seq_id": 4, "num_samples": 2,
              "prompt": {"chunks": [{"tokens": [1, 2, 3], "type": "encoded_text"}]}, "sampling_params": {"max_tokens": 3}}  # fmt: skip
    first, second = resend(client, "/api/v1/asample", json=sample)
    assert second.json() == first.json() and len(first.json()["sample_sequence_ids"]) == 2
    assert count(runtime, SAMPLE["requested"]) == 1
