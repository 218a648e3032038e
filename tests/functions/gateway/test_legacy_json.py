"""Older SDKs: JSON `/forward_backward` and `/forward` bodies (TensorData lists, 2-D CSR),
decoded to exactly what the protobuf body gives; bad data refused through its seq_id; JSON
results for polls that do not ask for protobuf, with the values the protobuf answer has."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from tinker import types as sdk_types
from tinker.proto.response_conv import deserialize_proto_response

from functions.gateway import proto_schema as pb
from functions.gateway.app import create_app
from functions.runtime import Runtime
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.events.lifecycle import RequestCompleted
from openrl_core.settings import Settings
from openrl_core.tensors import Array

KEY = "tml-legacy"
MODEL = "openrl/tiny-qwen3"
PROTO = {"Content-Type": "application/x-protobuf"}


@pytest.fixture
def api(tmp_path, tiny_files):
    runtime = Runtime(Settings(data_dir=tmp_path, models=[MODEL], api_keys=[f"alice={KEY}"], long_poll_seconds=0.5))
    with TestClient(create_app(runtime.gateway_context())) as client:
        client.headers["X-API-Key"] = KEY
        yield client, runtime
    runtime.close()


def new_model(client) -> str:
    session = client.post("/api/v1/create_session", json={}).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 4}}
    return client.post("/api/v1/create_model", json=body).json()["model_id"]


def stored(runtime, type_):
    return [event for _position, event in runtime.store.iterate() if event.type == type_]


# Two datums as tinker 0.22 writes them: a dense one split over two chunks, and one whose 2-D
# targets and weights travel as CSR (unlisted entries are 0).
JSON_DATA = [
    {
        "model_input": {
            "chunks": [{"tokens": [1, 2], "type": "encoded_text"}, {"tokens": [3], "type": "encoded_text"}]
        },
        "loss_fn_inputs": {
            "target_tokens": {"data": [2, 3, 4], "dtype": "int64", "shape": [3]},
            "weights": {"data": [0.0, 1.0, 0.5], "dtype": "float32", "shape": [3]},
        },
    },
    {
        "model_input": {"chunks": [{"tokens": [5, 6], "type": "encoded_text"}]},
        "loss_fn_inputs": {
            "target_tokens": {
                "data": [7, 9],
                "dtype": "int64",
                "shape": [2, 2],
                "sparse_crow_indices": [0, 1, 2],
                "sparse_col_indices": [0, 1],
            },
            "weights": {
                "data": [1.0, 2.0],
                "dtype": "float32",
                "shape": [2, 2],
                "sparse_crow_indices": [0, 1, 2],
                "sparse_col_indices": [0, 1],
            },
        },
    },
]


def proto_body(model_id: str, seq_id: int) -> bytes:
    message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    for chunks, inputs in (
        ([[1, 2], [3]], {"target_tokens": np.array([2, 3, 4]), "weights": np.array([0.0, 1.0, 0.5])}),
        ([[5, 6]], {"target_tokens": np.array([[7, 0], [0, 9]]), "weights": np.array([[1.0, 0.0], [0.0, 2.0]])}),
    ):
        datum = message.data.add()
        for tokens in chunks:
            datum.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype="<i4").tobytes()
        for name, value in inputs.items():
            tensor = datum.loss_fn_inputs[name]
            is_int = name == "target_tokens"
            tensor.dtype = pb.DTYPE["DTYPE_INT64" if is_int else "DTYPE_FLOAT32"]
            tensor.shape.extend(value.shape)
            tensor.dense = np.asarray(value, dtype="<i8" if is_int else "<f4").tobytes()
    return message.SerializeToString()


def json_body(model_id: str, seq_id: int, forward: bool = False, data=None, **extra) -> dict:
    key = "forward_input" if forward else "forward_backward_input"
    return {
        key: {"data": data if data is not None else JSON_DATA, "loss_fn": "cross_entropy", **extra},
        "model_id": model_id,
        "seq_id": seq_id,
    }


def test_a_json_body_becomes_the_same_request_as_its_protobuf_twin(api):
    client, runtime = api
    by_json, by_proto = new_model(client), new_model(client)
    assert client.post("/api/v1/forward_backward", json=json_body(by_json, 1)).status_code == 200
    assert client.post("/api/v1/forward_backward", content=proto_body(by_proto, 1), headers=PROTO).status_code == 200
    one, two = stored(runtime, te.FORWARD_BACKWARD["requested"])
    assert one.data.model_id == by_json and two.data.model_id == by_proto
    assert one.data.model_dump(exclude={"request_id", "model_id"}) == two.data.model_dump(
        exclude={"request_id", "model_id"}
    )
    sparse = one.data.data[1].to_datum()
    np.testing.assert_array_equal(sparse.loss_fn_inputs["target_tokens"], [[7, 0], [0, 9]])
    assert sparse.loss_fn_inputs["weights"].dtype == np.float32 and one.data.forward_only is False


def test_json_forward_is_a_forward_only_request_in_the_models_sequence(api):
    client, runtime = api
    model_id = new_model(client)
    future = client.post("/api/v1/forward", json=json_body(model_id, 1, forward=True))
    assert future.status_code == 200 and future.json()["model_id"] == model_id
    [event] = stored(runtime, te.FORWARD_BACKWARD["requested"])
    assert event.data.forward_only is True and event.data.seq_id == 1
    # the same seq_id through /forward_backward with another body is a conflict, not a second request
    assert client.post("/api/v1/forward_backward", json=json_body(model_id, 1)).status_code == 409


@pytest.mark.parametrize(
    "bad,fragment",
    [
        ({"data": [2.5, 3, 4], "dtype": "int64", "shape": [3]}, "non-integer"),
        ({"data": [2, 3, 4], "dtype": "float64", "shape": [3]}, "dtype"),
        ({"data": [2, 3], "dtype": "int64", "shape": [3]}, "shape [3]"),
        ({"data": [2], "dtype": "int64", "shape": [3, 1], "sparse_crow_indices": [0, 1, 1, 1]}, "sparse"),
    ],
)
def test_bad_json_data_is_refused_and_consumes_its_seq_id(api, bad, fragment):
    client, runtime = api
    model_id = new_model(client)
    data = [{**JSON_DATA[0], "loss_fn_inputs": {**JSON_DATA[0]["loss_fn_inputs"], "target_tokens": bad}}]
    if bad["dtype"] != "int64" or "sparse_crow_indices" in bad or bad["shape"] != [3]:
        data[0]["loss_fn_inputs"].pop("weights")  # keep the failure on target_tokens alone
    answer = client.post("/api/v1/forward_backward", json=json_body(model_id, 1, data=data))
    assert answer.status_code == 400 and fragment in answer.json()["detail"], answer.text
    assert stored(runtime, te.FORWARD_BACKWARD["requested"]) == []
    assert len(stored(runtime, te.SEQ_SKIPPED)) == 1  # the trainer is told not to wait for it
    assert client.post("/api/v1/forward_backward", json=json_body(model_id, 1)).status_code == 409


def test_a_body_without_its_envelope_or_of_another_type_is_a_clear_400(api):
    client, runtime = api
    model_id = new_model(client)
    no_seq = json_body(model_id, 1)
    del no_seq["seq_id"]
    answer = client.post("/api/v1/forward_backward", json=no_seq)
    assert answer.status_code == 400 and "seq_id" in answer.json()["detail"]
    answer = client.post("/api/v1/forward_backward", content=b"x=1", headers={"Content-Type": "text/plain"})
    assert answer.status_code == 400 and "application/json" in answer.json()["detail"]
    assert stored(runtime, te.SEQ_SKIPPED) == []


def test_results_come_as_json_to_a_poll_that_does_not_ask_for_protobuf(api):
    client, runtime = api
    model_id = new_model(client)
    request_id = client.post("/api/v1/forward_backward", json=json_body(model_id, 1)).json()["request_id"]
    logprobs = [
        np.array([-1.5, -2.0, -0.25], dtype=np.float32),
        np.array([[-3.0, -4.0], [-5.0, -6.0]], dtype=np.float32),
    ]
    result = {"loss_fn_output_type": "ArrayRecord", "metrics": {"loss:sum": 12.5},
              "loss_fn_outputs": [{"logprobs": Array.from_numpy(lp).model_dump()} for lp in logprobs]}  # fmt: skip
    done = new_event(
        te.FORWARD_BACKWARD["completed"],
        RequestCompleted(request_id=request_id, result=result),
        tenant="alice",
        source="/t",
    )
    runtime.store.append(done)

    as_json = client.post(
        "/api/v1/retrieve_future", json={"request_id": request_id}, headers={"Accept": "application/json"}
    )
    assert as_json.headers["content-type"] == "application/json"
    body = as_json.json()
    assert body["metrics"] == {"loss:sum": 12.5} and body["loss_fn_output_type"] == "ArrayRecord"
    assert body["loss_fn_outputs"][1]["logprobs"] == {
        "data": [-3.0, -4.0, -5.0, -6.0],
        "dtype": "float32",
        "shape": [2, 2],
    }

    # the protobuf answer, decoded by the 0.38 SDK, holds the same numbers
    as_proto = client.post(
        "/api/v1/retrieve_future", json={"request_id": request_id}, headers={"Accept": "application/x-protobuf"}
    )
    decoded = deserialize_proto_response(as_proto.content, sdk_types.ForwardBackwardOutput)
    for output, datum in zip(decoded.loss_fn_outputs, body["loss_fn_outputs"]):
        tensor = datum["logprobs"]
        np.testing.assert_array_equal(
            output["logprobs"].to_numpy(), np.array(tensor["data"], np.float32).reshape(tensor["shape"])
        )
    assert json.loads(as_json.content) == body
