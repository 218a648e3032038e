"""One large forward_backward that the SDK splits into chunks (1100 datums → 1024 + 76, sent
in parallel, the first chunk last) trains exactly like the same batch sent as one request.

Model A gets the batch through the SDK; model B (same seed, so the same initial adapter) gets
it as one protobuf body over raw HTTP, encoded by the SDK's own encoder. After the same
optimizer step, both models' forward logprobs are compared bitwise. Bitwise is expected
here, not just close: the first 1024 datums hold 1 token and the last 76 hold 2, and the
trainer groups a request's datums into microbatches of similar length, so the one request
runs as the same two microbatches as the two chunks, in the same order, and the gradients
are summed in the same order. A split inside a microbatch would match only up to float
summation order. (Short datums keep it fast: the cost is the 151936-token vocabulary.)
"""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_proto_response
from tinker.resources.training import AsyncTrainingResource

from tests.e2e.conftest import API_KEY
from tests.e2e.sdk_close import close_service

pytestmark = pytest.mark.e2e
MODEL = "openrl/tiny-qwen3"
DATUMS = 1100
ADAM = types.AdamParams(learning_rate=1e-2)


def batch(lengths: list[int], seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for length in lengths:
        row = rng.integers(100, 5000, size=length + 1).tolist()
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(row[:-1]),
                loss_fn_inputs={"target_tokens": row[1:], "weights": [1.0] * length},
            )
        )
    return data


class RawModel:
    """A model driven over plain HTTP with explicit seq_ids, as one request per call."""

    def __init__(self, url: str, model_id: str) -> None:
        self.http = httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": API_KEY}, timeout=60)
        self.model_id = model_id
        self.seq_id = 0

    def forward_backward(self, data, forward_only: bool = False) -> types.ForwardBackwardOutput:
        self.seq_id += 1
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
            model_id=self.model_id,
            seq_id=self.seq_id,
        )
        message = forward_backward_request_to_proto(request)
        message.forward_only = forward_only
        future = self.http.post(
            "/forward_backward", content=message.SerializeToString(), headers={"Content-Type": "application/x-protobuf"}
        )
        return deserialize_proto_response(self.result(future.json()["request_id"]).content, types.ForwardBackwardOutput)

    def optim_step(self, adam: types.AdamParams) -> dict:
        self.seq_id += 1
        body = {
            "model_id": self.model_id,
            "seq_id": self.seq_id,
            "adam_params": adam.model_dump(),
            "type": "optim_step",
        }
        return self.result(self.http.post("/optim_step", json=body).json()["request_id"]).json()

    def result(self, request_id: str) -> httpx.Response:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            answer = self.http.post(
                "/retrieve_future", json={"request_id": request_id}, headers={"Accept": "application/x-protobuf"}
            )
            if answer.status_code != 408:
                assert answer.status_code == 200 and "error" not in answer.headers.get("content-type", ""), answer.text
                return answer
        raise AssertionError(f"{request_id} never finished")


def test_sdk_chunks_train_exactly_like_one_request(sdk_env, monkeypatch):
    sent = []
    original = AsyncTrainingResource.forward_backward

    async def recording(self, *, request, forward_only=False):
        sent.append((request.seq_id, len(request.forward_backward_input.data)))
        return await original(self, request=request, forward_only=forward_only)

    monkeypatch.setattr(AsyncTrainingResource, "forward_backward", recording)
    service = tinker.ServiceClient()
    chunked = service.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
    single = RawModel(
        sdk_env.url, service.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result().model_id
    )
    data, probe = batch([1] * 1024 + [2] * (DATUMS - 1024), seed=0), batch([6, 6, 9, 3], seed=1)

    by_sdk = chunked.forward_backward(data, "cross_entropy").result()
    assert sent == [(2, DATUMS - 1024), (1, 1024)]  # two requests, the first chunk sent last
    by_one = single.forward_backward(data)
    assert len(by_sdk.loss_fn_outputs) == len(by_one.loss_fn_outputs) == DATUMS
    for a, b in zip(by_sdk.loss_fn_outputs, by_one.loss_fn_outputs):  # in request order
        np.testing.assert_array_equal(a["logprobs"].to_numpy(), b["logprobs"].to_numpy())
    assert by_sdk.metrics["loss:sum"] == pytest.approx(by_one.metrics["loss:sum"], rel=1e-6)

    chunked.optim_step(ADAM).result()
    single.optim_step(ADAM)
    after_sdk = chunked.forward(probe, "cross_entropy").result()
    after_one = single.forward_backward(probe, forward_only=True)
    for a, b in zip(after_sdk.loss_fn_outputs, after_one.loss_fn_outputs):
        np.testing.assert_array_equal(a["logprobs"].to_numpy(), b["logprobs"].to_numpy())
    before_probe = RawModel(
        sdk_env.url, service.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result().model_id
    )
    untrained = before_probe.forward_backward(probe, forward_only=True)
    moved = any(
        not np.array_equal(a["logprobs"].to_numpy(), u["logprobs"].to_numpy())
        for a, u in zip(after_sdk.loss_fn_outputs, untrained.loss_fn_outputs)
    )
    assert moved  # the step did change the weights, so the equality above means something
    close_service(service)
