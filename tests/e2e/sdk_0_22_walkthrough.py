"""The walkthrough with tinker 0.22.7, run by `test_sdk_compat.py` under `.venv-sdk-0.22`.

A flat script on purpose: that venv holds only the old SDK (no OpenRL, no torch), so this
file imports nothing from the repository. It reads TINKER_BASE_URL / TINKER_API_KEY, asserts
as it goes, and prints one JSON line of facts for the test to check:

create → three rounds of forward_backward + optim_step (JSON bodies: the server does not
turn on `proto_write_fwdbwd`), loss falling → forward (JSON `POST /forward`) →
save_weights_and_get_sampling_client → sample → compute_logprobs → save_state → train on
→ load_state_with_optimizer (bitwise back) → create_training_client_from_state_with_optimizer.

Along the way it counts what the server made the SDK handle: 408 try_again answers and
complete_metadata answers (the server runs with a short long-poll and a tiny metadata
threshold), and it re-fetches finished futures with `Accept: application/json` to check that
the JSON results parse with this SDK's own models.
"""

from __future__ import annotations

import json
import os
import sys

import httpx
import numpy as np
import tinker
from tinker import types
from tinker._client import AsyncTinker
from tinker.lib import api_future_impl
from tinker.lib._pydantic_conv import deserialize_json_response

MODEL = "openrl/tiny-qwen3"
TEXT = "The quick brown fox jumps over the lazy dog. " * 3

seen = {"408": 0, "complete_metadata": 0, "futures": [], "json_forward_calls": 0, "json_fwdbwd_calls": 0}

_to_transport_error = api_future_impl._rest_status_error_to_transport_error


def _counting_transport_error(error):
    if error.response.status_code == 408:
        seen["408"] += 1
    return _to_transport_error(error)


api_future_impl._rest_status_error_to_transport_error = _counting_transport_error
_handle_outcome = api_future_impl._APIFuture._handle_outcome


async def _counting_outcome(self, outcome, *args, **kwargs):
    if isinstance(outcome, api_future_impl._MetadataOnly):
        seen["complete_metadata"] += 1
    return await _handle_outcome(self, outcome, *args, **kwargs)


api_future_impl._APIFuture._handle_outcome = _counting_outcome
_future_init = api_future_impl._APIFuture.__init__


def _recording_init(self, model_cls, holder, untyped_future, *args, **kwargs):
    seen["futures"].append((model_cls, untyped_future.request_id))
    _future_init(self, model_cls, holder, untyped_future, *args, **kwargs)


api_future_impl._APIFuture.__init__ = _recording_init
_post = AsyncTinker.post


async def _counting_post(self, path, *args, **kwargs):
    body = kwargs.get("body")
    if path in ("/api/v1/forward", "/api/v1/forward_backward") and isinstance(body, dict):
        seen["json_forward_calls" if path == "/api/v1/forward" else "json_fwdbwd_calls"] += 1
    return await _post(self, path, *args, **kwargs)


AsyncTinker.post = _counting_post


def make_batch(tokenizer) -> list[types.Datum]:
    tokens = tokenizer.encode(TEXT)
    half = len(tokens) // 2
    batch = []
    for piece in (tokens, tokens[:half] + tokens[-4:]):
        weights = [0.0] * 3 + [1.0] * (len(piece) - 4)
        batch.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(piece[:-1]),
                loss_fn_inputs={"target_tokens": piece[1:], "weights": weights},
            )
        )
    return batch


def loss(output) -> float:
    return float(output.metrics["loss:sum"])


def refetch_as_json(model_cls, request_id: str):
    """The same finished future, asked for without protobuf in Accept (as SDKs before 0.2x did)."""
    response = httpx.post(
        os.environ["TINKER_BASE_URL"] + "/api/v1/retrieve_future",
        json={"request_id": request_id, "allow_metadata_only": False},
        headers={"X-API-Key": os.environ["TINKER_API_KEY"], "Accept": "application/json"},
        timeout=60,
    )
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/json"), (
        response.text
    )
    return deserialize_json_response(response.json(), model_cls)


def main() -> None:
    assert tinker.__version__ == "0.22.7", tinker.__version__
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=0)
    assert training.get_info().model_data.model_name == MODEL
    tokenizer = training.get_tokenizer()
    batch = make_batch(tokenizer)

    adam = types.AdamParams(learning_rate=5e-3)
    pending = [(training.forward_backward(batch, "cross_entropy"), training.optim_step(adam)) for _ in range(3)]
    losses = []
    for fb, opt in pending:
        output = fb.result()
        opt.result()
        assert len(output.loss_fn_outputs) == len(batch)
        for out, datum in zip(output.loss_fn_outputs, batch):
            assert out["logprobs"].to_numpy().shape == datum.loss_fn_inputs["target_tokens"].to_numpy().shape
        losses.append(loss(output))
    assert losses[0] > losses[1] > losses[2], losses

    forward = training.forward(batch, "cross_entropy").result()
    assert loss(forward) < losses[2]
    logprobs_by_forward = forward.loss_fn_outputs[0]["logprobs"].to_numpy()

    sampler = training.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(tokenizer.encode("The quick brown fox"))
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    response = sampler.sample(prompt=prompt, num_samples=2, sampling_params=params).result()
    assert len(response.sequences) == 2
    for sequence in response.sequences:
        assert 1 <= len(sequence.tokens) <= 8 and len(sequence.logprobs) == len(sequence.tokens)

    full = batch[0].model_input.to_ints() + [int(batch[0].loss_fn_inputs["target_tokens"].to_numpy()[-1])]
    prompt_logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert prompt_logprobs[0] is None
    np.testing.assert_allclose(np.array(prompt_logprobs[1:], dtype=np.float32), logprobs_by_forward, atol=2e-4)

    state_path = training.save_state("old-sdk-state").result().path
    assert state_path == f"tinker://{training.model_id}/weights/old-sdk-state"
    training.forward_backward(batch, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert abs(loss(training.forward(batch, "cross_entropy").result()) - loss(forward)) > 1e-3
    training.load_state_with_optimizer(state_path).result()
    back = training.forward(batch, "cross_entropy").result()
    np.testing.assert_array_equal(back.loss_fn_outputs[0]["logprobs"].to_numpy(), logprobs_by_forward)

    # 0.22 builds a client from a checkpoint in three calls: POST /weights_info (REST) for the
    # LoRA shape, create_model, then an in-place load_weights with the optimizer state.
    restored = service.create_training_client_from_state_with_optimizer(state_path)
    assert restored.model_id != training.model_id
    again = restored.forward(batch, "cross_entropy").result()
    np.testing.assert_array_equal(again.loss_fn_outputs[0]["logprobs"].to_numpy(), logprobs_by_forward)

    # JSON results (for SDKs that do not ask for protobuf) parse with this SDK's models.
    checked = set()
    for model_cls, request_id in seen["futures"]:
        if model_cls in (types.ForwardBackwardOutput, types.SampleResponse) and model_cls not in checked:
            parsed = refetch_as_json(model_cls, request_id)
            if model_cls is types.SampleResponse:
                assert len(parsed.sequences) >= 1 and parsed.sequences[0].tokens
            else:
                assert parsed.loss_fn_outputs and "loss:sum" in parsed.metrics
            checked.add(model_cls)
    assert len(checked) == 2, checked

    facts = {key: value for key, value in seen.items() if key != "futures"}
    print(json.dumps({**facts, "losses": losses, "json_checked": len(checked)}))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # the SDK's background threads (heartbeat, telemetry) would keep it alive
