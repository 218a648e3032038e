"""Bad input: a clear 4xx with a `detail` that says what is wrong, never a 500, never an
empty 400, and nothing already stored changes. Also authentication and tenancy."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from eventing.store import tables
from functions.gateway import proto_schema as pb
from functions.gateway.app import create_app
from functions.runtime import Runtime
from openrl_core.settings import Settings

ALICE, BOB = "tml-test-alice", "tml-test-bob"
MODEL = "openrl/tiny-qwen3"


@pytest.fixture
def api(tmp_path, tiny_files):
    settings = Settings(data_dir=tmp_path, models=[MODEL], api_keys=[f"alice={ALICE}", f"bob={BOB}"])
    runtime = Runtime(settings)
    with TestClient(create_app(runtime.gateway_context())) as client:
        yield client, runtime
    runtime.close()


def call(client, path, body=None, key=ALICE, **kwargs):
    headers = {"X-API-Key": key} if key else {}
    headers.update(kwargs.pop("headers", {}))
    if isinstance(body, (bytes, bytearray)):
        return client.post(path, content=body, headers=headers, **kwargs)
    return client.post(path, json=body, headers=headers, **kwargs)


def session_and_model(client, key=ALICE):
    session_id = call(client, "/api/v1/create_session", {"tags": [], "user_metadata": {}}, key).json()["session_id"]
    future = call(client, "/api/v1/create_model", {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL,
                                                   "lora_config": {"rank": 4}}, key).json()  # fmt: skip
    return session_id, future["model_id"]


def fb_body(model_id, seq_id=1, tokens=(1, 2, 3), targets=(2, 3, 4), weights=(1.0, 1.0, 1.0), loss_fn="cross_entropy"):
    message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn)
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype="<i4").tobytes()
    for name, values, dtype, wire in (
        ("target_tokens", targets, "<i8", "DTYPE_INT64"),
        ("weights", weights, "<f4", "DTYPE_FLOAT32"),
    ):
        if values is None:
            continue
        tensor = datum.loss_fn_inputs[name]
        tensor.dtype = pb.DTYPE[wire]
        tensor.shape.append(len(values))
        tensor.dense = np.asarray(values, dtype=dtype).tobytes()
    return message.SerializeToString()


PROTO = {"Content-Type": "application/x-protobuf"}


def snapshot(runtime):
    """Every projection row, to prove a refused request changed none of them."""
    with runtime.engine.connect() as conn:
        return {
            name: conn.execute(select(table)).all()
            for name, table in tables.metadata.tables.items()
            if name not in ("events", "submissions")
        }


def count_events(runtime, type_fragment):
    with runtime.engine.connect() as conn:
        return conn.execute(select(func.count()).where(tables.events.c.type.contains(type_fragment))).scalar()


def assert_clear_4xx(response, status, fragment):
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str) and fragment in detail, detail


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(targets=(2, 3)), "first dimension must equal"),
        (dict(weights=(1.0, 1.0)), "must match target_tokens"),
        (dict(tokens=(1, 2, 999999)), "outside the vocabulary"),
        (dict(targets=(2, 3, -5)), "outside the vocabulary"),
        (dict(loss_fn="mse"), "unknown loss_fn"),
        (dict(loss_fn="importance_sampling"), "lacks"),
        (dict(tokens=()), "at least one token"),
    ],
)
def test_bad_forward_backward_is_refused_and_stores_nothing(api, kwargs, fragment):
    client, runtime = api
    _sid, model_id = session_and_model(client)
    before = snapshot(runtime)
    response = call(client, "/api/v1/forward_backward", fb_body(model_id, **kwargs), headers=PROTO)
    assert_clear_4xx(response, 400, fragment)
    assert snapshot(runtime) == before
    assert count_events(runtime, "forward_backward.requested") == 0
    # the refused seq_id is consumed: the trainer is told to skip it, and it cannot be reused
    assert count_events(runtime, "seq.skipped") == 1
    reuse = call(client, "/api/v1/forward_backward", fb_body(model_id), headers=PROTO)
    assert reuse.status_code == 409 and "refused" in reuse.json()["detail"]
    assert call(client, "/api/v1/forward_backward", fb_body(model_id, seq_id=2), headers=PROTO).status_code == 200


@pytest.mark.parametrize("body", [b"\xff\xfe\xfd", b"\x0a\x10short"])
def test_malformed_protobuf(api, body):
    client, runtime = api
    session_and_model(client)
    before = snapshot(runtime)
    assert_clear_4xx(
        call(client, "/api/v1/forward_backward", body, headers=PROTO), 400, "not a valid ForwardBackwardRequest"
    )
    assert snapshot(runtime) == before


def test_unknown_model_and_tenancy(api):
    client, runtime = api
    _sid, model_id = session_and_model(client)
    assert_clear_4xx(
        call(client, "/api/v1/forward_backward", fb_body("nope:train:0"), headers=PROTO), 404, "unknown model_id"
    )
    # bob sees alice's model exactly as if it did not exist
    before = snapshot(runtime)
    assert_clear_4xx(
        call(client, "/api/v1/forward_backward", fb_body(model_id), key=BOB, headers=PROTO), 404, "unknown model_id"
    )
    assert_clear_4xx(call(client, "/api/v1/get_info", {"model_id": model_id}, key=BOB), 404, "unknown model_id")
    assert_clear_4xx(
        call(client, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 1}, key=BOB), 404, "unknown model_id"
    )
    assert snapshot(runtime) == before
    future = call(client, "/api/v1/forward_backward", fb_body(model_id), headers=PROTO).json()
    lookup = call(client, "/api/v1/retrieve_future", {"request_id": future["request_id"]}, key=BOB)
    assert_clear_4xx(lookup, 404, "unknown request_id")


def test_authentication(api):
    client, _ = api
    assert_clear_4xx(call(client, "/api/v1/create_session", {}, key=None), 401, "missing X-API-Key")
    assert_clear_4xx(call(client, "/api/v1/create_session", {}, key="tml-who-is-this"), 401, "unknown API key")
    assert call(client, "/api/v1/create_session", {}).status_code == 200
    assert client.get("/api/v1/healthz").json() == {"status": "ok"}


@pytest.mark.parametrize(
    "path,body,status,fragment",
    [
        (
            "/api/v1/create_model",
            {"session_id": "SID", "model_seq_id": 1, "base_model": "gpt-17"},
            400,
            "unknown base_model",
        ),
        (
            "/api/v1/create_model",
            {"session_id": "SID", "model_seq_id": 1, "base_model": MODEL},
            400,
            "lora_config is required",
        ),
        (
            "/api/v1/create_model",
            {"session_id": "SID", "model_seq_id": 1, "base_model": MODEL, "lora_config": {"rank": 0}},
            400,
            "rank",
        ),
        (
            "/api/v1/create_model",
            {"session_id": "nope", "model_seq_id": 1, "base_model": MODEL, "lora_config": {"rank": 4}},
            404,
            "unknown session_id",
        ),
        ("/api/v1/create_model", {"model_seq_id": 1}, 400, "session_id"),
        (
            "/api/v1/optim_step",
            {"model_id": "MID", "seq_id": 1, "adam_params": {"learning_rate": -1}},
            400,
            "learning_rate",
        ),
        ("/api/v1/optim_step", {"model_id": "MID", "seq_id": 1, "adam_params": {"beta1": 1.5}}, 400, "beta1"),
        ("/api/v1/save_weights", {"model_id": "MID", "seq_id": 1, "path": "../escape"}, 400, "checkpoint name"),
        (
            "/api/v1/load_weights",
            {"model_id": "MID", "seq_id": 1, "path": "tinker://x/weights/../../etc"},
            400,
            "checkpoint path",
        ),
        (
            "/api/v1/load_weights",
            {"session_id": "SID", "model_seq_id": 3, "path": "tinker://SID:train:0/weights/none"},
            404,
            "not found",
        ),
        (
            "/api/v1/create_sampling_session",
            {"session_id": "SID", "sampling_session_seq_id": 0},
            400,
            "base_model or a model_path",
        ),
        (
            "/api/v1/create_sampling_session",
            {"session_id": "SID", "sampling_session_seq_id": 0, "base_model": "gpt-17"},
            400,
            "unknown base_model",
        ),
        (
            "/api/v1/asample",
            {"sampling_session_id": "nope", "prompt": {"chunks": []}, "sampling_params": {}},
            404,
            "unknown sampling_session_id",
        ),
        ("/api/v1/retrieve_future", {"request_id": "req-nope"}, 404, "unknown request_id"),
        ("/api/v1/session_heartbeat", {"session_id": "nope"}, 404, "unknown session_id"),
    ],
)
def test_route_cases(api, path, body, status, fragment):
    client, runtime = api
    session_id, model_id = session_and_model(client)
    text = json.dumps(body).replace("SID", session_id).replace("MID", model_id)
    before = snapshot(runtime)
    response = client.post(path, content=text, headers={"X-API-Key": ALICE, "Content-Type": "application/json"})
    assert_clear_4xx(response, status, fragment)
    assert snapshot(runtime) == before


def test_sample_input_checks(api):
    client, runtime = api
    session_id, _ = session_and_model(client)
    sampler = call(
        client,
        "/api/v1/create_sampling_session",
        {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": MODEL},
    ).json()
    base = {"sampling_session_id": sampler["sampling_session_id"], "seq_id": 1, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}, "sampling_params": {"max_tokens": 4}}  # fmt: skip
    cases = [
        ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": []}]}}, "no tokens"),
        ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 10**7]}]}}, "outside the vocabulary"),
        ({"num_samples": 0}, "num_samples"),
        ({"sampling_params": {"max_tokens": 10**6}}, "exceeds the model context"),
        ({"sampling_params": {"top_k": 0}}, "top_k"),
        ({"sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"sampling_params": {"temperature": -1}}, "temperature"),
        ({"prompt": {"chunks": [{"type": "image", "data": "AAAA", "format": "png"}]}}, "only text models"),
        ({"prompt_logprobs_last_n": 1}, "needs prompt_logprobs"),
    ]
    for change, fragment in cases:
        before = snapshot(runtime)
        assert_clear_4xx(call(client, "/api/v1/asample", {**base, **change}), 400, fragment)
        assert snapshot(runtime) == before


def test_numbers_past_int64_are_a_400_not_a_500(api):
    """JSON integers have no bound; numpy arrays and the store's columns do (the fuzz run found
    each of these a 500): a token, a tensor value, shape or index, a cursor or a position past
    64 bits is a 400 that says so."""
    client, runtime = api
    session_id, model_id = session_and_model(client)
    huge = 2**70
    datum = {"model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
             "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4], "dtype": "int64"}, "weights": {"data": [1.0, 1.0, 1.0], "dtype": "float32"}}}  # fmt: skip
    bad_data = [
        {**datum, "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, huge, 3]}]}},
        {
            **datum,
            "loss_fn_inputs": {**datum["loss_fn_inputs"], "target_tokens": {"data": [2, huge, 4], "dtype": "int64"}},
        },
        {
            **datum,
            "loss_fn_inputs": {
                **datum["loss_fn_inputs"],
                "target_tokens": {"data": [2.0, 9.3e18, 4.0], "dtype": "int64"},
            },
        },
        {
            **datum,
            "loss_fn_inputs": {**datum["loss_fn_inputs"], "weights": {"data": [1.0, 1e39, 1.0], "dtype": "float32"}},
        },
        {
            **datum,
            "loss_fn_inputs": {
                **datum["loss_fn_inputs"],
                "weights": {
                    "data": [1.0],
                    "dtype": "float32",
                    "shape": [1, huge],
                    "sparse_crow_indices": [0, 1],
                    "sparse_col_indices": [huge],
                },
            },
        },  # fmt: skip
    ]
    for seq_id, data in enumerate(bad_data, start=1):
        body = {
            "model_id": model_id,
            "seq_id": seq_id,
            "forward_backward_input": {"data": [data], "loss_fn": "cross_entropy"},
        }
        assert_clear_4xx(call(client, "/api/v1/forward_backward", body), 400, "outside")
    before = snapshot(runtime)
    target = {"sampling_session_id": f"{session_id}:sample:0"}
    assert_clear_4xx(
        call(client, "/api/v1/retrieve_futures", {"target": target, "prev_cursor": huge}), 400, "prev_cursor"
    )
    runs = "/api/openrl/v1/runs/" + model_id
    headers = {"X-API-Key": ALICE}
    assert_clear_4xx(client.get(f"{runs}/events?after={huge}", headers=headers), 400, "after must be between")
    assert_clear_4xx(
        client.get(f"{runs}/events", headers={**headers, "Last-Event-ID": str(huge)}), 400, "Last-Event-ID"
    )
    assert_clear_4xx(client.get(f"{runs}/metrics?after_step={huge}", headers=headers), 400, "after_step")
    assert snapshot(runtime) == before


def test_a_cancel_reason_that_is_not_a_string_is_refused(api):
    client, runtime = api
    _, model_id = session_and_model(client)
    before = snapshot(runtime)
    for reason in (0, False, [], 7):  # a falsy one was once taken as no reason (found by the fuzz run)
        answer = client.post(
            f"/api/openrl/v1/runs/{model_id}/cancel", json={"reason": reason}, headers={"X-API-Key": ALICE}
        )
        assert_clear_4xx(answer, 400, "reason must be a string")
    assert snapshot(runtime) == before


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_nan_or_infinity_in_free_form_json_is_a_400(api, token):
    """Python's and pydantic's JSON parsers take these bare tokens, JSON does not, and
    PostgreSQL's JSON columns refuse them: a session or run whose user_metadata held one was
    stored on SQLite and failed on PostgreSQL. Refused alike everywhere, nested or not."""
    client, runtime = api
    session_id, model_id = session_and_model(client)
    before = snapshot(runtime)
    bodies = [
        ("/api/v1/create_session", '{"tags": [], "user_metadata": {"a": %s}}'),
        ("/api/v1/create_session", '{"tags": [], "user_metadata": {"a": {"b": [1, %s]}}}'),
        ("/api/v1/create_model", '{"session_id": "SID", "model_seq_id": 1, "base_model": "MODEL", "lora_config": {"rank": 4}, '
                                 '"user_metadata": {"x": [%s]}}'),
        ("/api/v1/optim_step", '{"model_id": "MID", "seq_id": 1, "optimizer_params": {"lr": %s}}'),
    ]  # fmt: skip
    for path, template in bodies:
        text = (template % token).replace("SID", session_id).replace("MID", model_id).replace("MODEL", MODEL)
        response = client.post(path, content=text, headers={"X-API-Key": ALICE, "Content-Type": "application/json"})
        assert_clear_4xx(response, 400, "NaN or infinity")
    assert snapshot(runtime) == before
    # Finite numbers, big integers and nulls are JSON and go through.
    fine = '{"tags": [], "user_metadata": {"a": 1.5e300, "b": 123456789012345678901234567890, "c": null}}'
    assert (
        client.post(
            "/api/v1/create_session", content=fine, headers={"X-API-Key": ALICE, "Content-Type": "application/json"}
        ).status_code
        == 200
    )
