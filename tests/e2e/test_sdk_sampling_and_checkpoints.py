"""More of the SDK surface against a real server: named sampler checkpoints and
`create_sampling_client(model_path=…)`, sampling parameters through the wire, in-place
`load_state`, and tenancy between two API keys."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import API_KEY, OTHER_KEY
from tests.e2e.sdk_close import close_service

pytestmark = pytest.mark.e2e
MODEL = "openrl/tiny-qwen3"


def trained_client(service, steps=2):
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    tokens = training.get_tokenizer().encode("one two three four five six seven eight nine ten")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    for _ in range(steps):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return training, datum


def test_named_sampler_checkpoint_and_sampling_parameters(sdk_env):
    service = tinker.ServiceClient()
    training, datum = trained_client(service)
    path = training.save_weights_for_sampler("named-v1").result().path
    assert path == f"tinker://{training.model_id}/sampler_weights/named-v1"
    sampler = service.create_sampling_client(model_path=path).result()  # learns base_model via GET /samplers
    assert sampler.get_base_model() == MODEL
    prompt = datum.model_input

    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    first = sampler.sample(prompt, 2, greedy).result()
    assert first.sequences[0].tokens == first.sequences[1].tokens  # temperature 0 is greedy

    stop_token = first.sequences[0].tokens[2]
    stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[stop_token])).result()
    assert stopped.sequences[0].tokens == first.sequences[0].tokens[:3]  # the stop token is kept
    assert stopped.sequences[0].stop_reason == "stop"
    assert (
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, temperature=0.0, stop=[]))
        .result()
        .sequences[0]
        .stop_reason
        == "length"
    )

    top_k = sampler.sample(
        prompt,
        1,
        types.SamplingParams(max_tokens=1, temperature=0.0),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    ).result()
    assert top_k.prompt_logprobs[0] is None and len(top_k.prompt_logprobs) == prompt.length
    assert top_k.topk_prompt_logprobs[0] is None
    for position in range(1, prompt.length):
        row = top_k.topk_prompt_logprobs[position]
        assert len(row) == 3 and row[0][1] >= row[1][1] >= row[2][1]
        assert top_k.prompt_logprobs[position] <= row[0][1] + 1e-5  # the actual token is never above the best

    # the same adapter, reached through the training client's own sampling session
    ephemeral = training.save_weights_and_get_sampling_client().result()
    assert ephemeral.sample(prompt, 2, greedy).result().sequences[0].tokens == first.sequences[0].tokens
    close_service(service)


def test_in_place_load_state_restores_the_weights(sdk_env):
    service = tinker.ServiceClient()
    training, datum = trained_client(service)
    saved = training.save_state("before-more").result().path
    reference = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    moved = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert not np.allclose(moved, reference)
    training.load_state(saved).result()
    back = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(back, reference)
    close_service(service)


def test_another_tenant_cannot_touch_the_checkpoint(sdk_env, monkeypatch):
    alice = tinker.ServiceClient(api_key=API_KEY)
    training, _ = trained_client(alice, steps=1)
    path = training.save_state("private").result().path
    bob = tinker.ServiceClient(api_key=OTHER_KEY)
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(path).result()
    with pytest.raises(tinker.NotFoundError):
        bob.create_sampling_client(model_path=path).result()
    close_service(alice)
    close_service(bob)
