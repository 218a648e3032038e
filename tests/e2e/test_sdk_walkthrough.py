"""The unmodified tinker SDK against a real `openrl serve`: the whole walking skeleton.

create → three rounds of forward_backward + optim_step submitted back to back (the loss
falls) → forward → save_weights_and_get_sampling_client → sample → compute_logprobs →
save_state → create_training_client_from_state_with_optimizer → close. Along the way the
sampler's logprobs are checked against the trainer's forward pass on the same weights,
and the restored client against the original (same logprobs, same next step).
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.sdk_close import close_service

pytestmark = pytest.mark.e2e

MODEL = "openrl/tiny-qwen3"
TEXT = "The quick brown fox jumps over the lazy dog. " * 3


def make_batch(tokenizer) -> list[types.Datum]:
    tokens = tokenizer.encode(TEXT)
    half = len(tokens) // 2
    batch = []
    for piece in (tokens, tokens[:half] + tokens[-4:]):
        weights = [0.0] * 3 + [1.0] * (len(piece) - 4)  # no loss on the first prompt tokens
        batch.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(piece[:-1]),
                loss_fn_inputs={"target_tokens": piece[1:], "weights": weights},
            )
        )
    return batch


def total_loss(output) -> float:
    return float(output.metrics["loss:sum"])


def weighted_nll(output, batch) -> float:
    return -sum(
        float(np.dot(out["logprobs"].to_numpy(), datum.loss_fn_inputs["weights"].to_numpy()))
        for out, datum in zip(output.loss_fn_outputs, batch)
    )


def test_walkthrough(sdk_env):
    walkthrough(tinker.ServiceClient())


def walkthrough(service: "tinker.ServiceClient") -> None:
    """The whole skeleton through one service client; the distributed suite reuses it."""
    training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=0).result()
    info = training.get_info()
    assert info.model_data.model_name == MODEL and info.lora_rank == 8
    tokenizer = training.get_tokenizer()  # the local tokenizer directory, no hub
    assert tokenizer.encode("Hello world") == [9707, 1879]  # the real Qwen vocabulary
    batch = make_batch(tokenizer)

    # Three rounds submitted back to back, results awaited only at the end.
    adam = types.AdamParams(learning_rate=5e-3)
    pending = []
    for _ in range(3):
        pending.append((training.forward_backward(batch, "cross_entropy"), training.optim_step(adam)))
    losses = []
    for fb, opt in pending:
        output = fb.result()
        metrics = opt.result().metrics
        assert set(metrics) >= {"grad_norm"} or any("grad_norm" in key for key in metrics)
        assert len(output.loss_fn_outputs) == len(batch)
        for out, datum in zip(output.loss_fn_outputs, batch):
            assert out["logprobs"].to_numpy().shape == datum.loss_fn_inputs["target_tokens"].to_numpy().shape
        # loss:sum is exactly the weighted negative log-likelihood of the returned logprobs
        assert total_loss(output) == pytest.approx(weighted_nll(output, batch), rel=1e-4)
        losses.append(total_loss(output))
    assert losses[0] > losses[1] > losses[2], losses

    forward = training.forward(batch, "cross_entropy").result()
    assert total_loss(forward) < losses[2]

    sampler = training.save_weights_and_get_sampling_client().result()
    prompt_tokens = tokenizer.encode("The quick brown fox")
    prompt = types.ModelInput.from_ints(prompt_tokens)
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    response = sampler.sample(prompt=prompt, num_samples=3, sampling_params=params).result()
    assert len(response.sequences) == 3
    for sequence in response.sequences:
        assert 1 <= len(sequence.tokens) <= 8
        assert len(sequence.logprobs) == len(sequence.tokens)
        assert sequence.stop_reason in ("stop", "length")
    again = sampler.sample(prompt=prompt, num_samples=3, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in response.sequences]  # same seed

    # The sampler and the trainer agree on the same weights: prompt logprobs from the sampler
    # equal the trainer's forward logprobs for the same sequence.
    full = batch[0].model_input.to_ints() + [int(batch[0].loss_fn_inputs["target_tokens"].to_numpy()[-1])]
    sampled_logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert sampled_logprobs[0] is None
    trained_logprobs = training.forward([batch[0]], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(np.array(sampled_logprobs[1:], dtype=np.float32), trained_logprobs, atol=2e-4)

    # Save the full state, restore it into a new client, and check both continue identically.
    state_path = training.save_state("e2e-state").result().path
    assert state_path == f"tinker://{training.model_id}/weights/e2e-state"
    restored = service.create_training_client_from_state_with_optimizer(state_path).result()
    assert restored.model_id != training.model_id
    before = restored.forward(batch, "cross_entropy").result()
    assert total_loss(before) == pytest.approx(total_loss(forward), rel=1e-5)
    step = types.AdamParams(learning_rate=5e-3)
    for client in (training, restored):
        client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(step).result()
    after = [total_loss(c.forward(batch, "cross_entropy").result()) for c in (training, restored)]
    assert after[0] == pytest.approx(after[1], rel=1e-5)

    close_service(service)
