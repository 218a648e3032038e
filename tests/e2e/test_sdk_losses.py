"""Every built-in loss through the real SDK: the wire carries the loss, its inputs and its
`loss_fn_config`, and the server's `loss:sum` equals a float64 reference computed here from
the logprobs it returned (the trainer's unit tests check the gradients; this checks that the
config keys arrive and the defaults apply).

Sampler logprobs `q` are the learner's own logprobs shifted by up to ±0.6 nats (plus a lean
against the advantage's sign), so the ratios r = exp(lp - q) fall on both sides of every clip
range and clipping matters. Also here: the
client-side custom-loss path (`forward_backward_custom`, two requests through forward
logprobs) takes the same optimizer step as `cross_entropy` with the weights it implies.
`stable_reinforce`, which trains on the sampler's records, is tested in
`test_sdk_stable_reinforce.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.e2e.conftest import API_KEY
from tests.e2e.sdk_close import close_service

pytestmark = pytest.mark.e2e

MODEL = "openrl/tiny-qwen3"
PROMPTS = ("The quick brown fox", "Once upon a time there", "Two plus two equals")
COMPLETIONS = (" jumps over the lazy dog.", " lived a tiny model on a laptop.", " four, said the model.")
ADVANTAGES = (1.0, -0.5, 0.75)
# Tinker's documented defaults (ppo, and cispo's one-sided range from the cookbook tutorial);
# dro's beta is OpenRL's, as Tinker documents none.
DEFAULTS = {
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.05},
}


@pytest.fixture(scope="module")
def rig(server):
    """A training client plus sequences whose current logprobs are known."""
    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    tokenizer = training.get_tokenizer()
    sequences = []
    for prompt, completion in zip(PROMPTS, COMPLETIONS):
        prompt_tokens, completion_tokens = tokenizer.encode(prompt), tokenizer.encode(completion)
        sequences.append((prompt_tokens, completion_tokens))
    probe = [
        types.Datum(model_input=types.ModelInput.from_ints((p + c)[:-1]), loss_fn_inputs={"target_tokens": (p + c)[1:]})
        for p, c in sequences
    ]
    current = [
        out["logprobs"].to_numpy().astype(np.float64)
        for out in training.forward(probe, "cross_entropy").result().loss_fn_outputs
    ]
    yield training, sequences, current
    close_service(service)


def rl_batch(sequences, current, with_mask: bool) -> tuple[list[types.Datum], list[dict[str, np.ndarray]]]:
    """Cookbook-shaped RL datums: prompt positions carry q = 0 and A = 0."""
    rng = np.random.default_rng(0)
    data, inputs = [], []
    for (prompt, completion), lp, advantage in zip(sequences, current, ADVANTAGES):
        tokens = prompt + completion
        n, ob = len(tokens) - 1, len(prompt) - 1
        sampled = np.arange(n) >= ob
        # Leaning against the advantage puts GSPO's sequence ratio past the clip that binds.
        shift = rng.uniform(-0.6, 0.6, n) - 0.3 * np.sign(advantage)
        q = np.where(sampled, lp + shift, 0.0).astype(np.float32)
        row = {
            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
            "logprobs": q,
            "advantages": np.where(sampled, advantage, 0.0).astype(np.float32),
        }
        if with_mask:
            row["sequence_ratio_mask"] = sampled.astype(np.float32)
        inputs.append(row)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={k: v.tolist() for k, v in row.items()},
            )
        )
    return data, inputs


def reference_loss(loss_fn: str, lp_by_datum, inputs_by_datum, config: dict) -> float:
    """Tinker's definitions (per token, summed over tokens and datums), in float64."""
    total = 0.0
    for lp, inputs in zip(lp_by_datum, inputs_by_datum):
        lp = lp.astype(np.float64)
        if loss_fn == "cross_entropy":
            total += -(lp * inputs["weights"].astype(np.float64)).sum()
            continue
        q, adv = inputs["logprobs"].astype(np.float64), inputs["advantages"].astype(np.float64)
        ratio = np.exp(lp - q)
        low = inputs.get("clip_low_threshold", config.get("clip_low_threshold"))
        high = inputs.get("clip_high_threshold", config.get("clip_high_threshold"))
        if loss_fn == "importance_sampling":
            total += -(ratio * adv).sum()
        elif loss_fn == "ppo":
            total += -np.minimum(ratio * adv, np.clip(ratio, low, high) * adv).sum()
        elif loss_fn == "cispo":
            total += -(np.clip(ratio, low, high) * lp * adv).sum()
        elif loss_fn == "dro":
            total += -(lp * adv - 0.5 * config["beta"] * (lp - q) ** 2).sum()
        elif loss_fn == "gspo":
            mask = inputs["sequence_ratio_mask"] != 0 if "sequence_ratio_mask" in inputs else adv != 0
            sequence_ratio = np.exp((lp - q)[mask].mean())
            total += -np.minimum(sequence_ratio * adv, np.clip(sequence_ratio, low, high) * adv).sum()
        else:
            raise AssertionError(loss_fn)
    return total


CASES = [
    ("importance_sampling", None, True),
    ("ppo", None, True),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}, True),
    ("cispo", None, True),
    ("cispo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.1}, True),
    ("dro", None, True),
    ("dro", {"beta": 0.7}, True),
    ("gspo", None, True),
    ("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, True),
    ("gspo", None, False),  # no mask: the sequence ratio is taken over the positions with an advantage
]


@pytest.mark.parametrize("loss_fn, config, with_mask", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rl_loss_sum_matches_the_reference(rig, loss_fn, config, with_mask):
    training, sequences, current = rig
    data, inputs = rl_batch(sequences, current, with_mask and loss_fn == "gspo")
    output = training.forward_backward(data, loss_fn, config).result()
    returned = [out["logprobs"].to_numpy() for out in output.loss_fn_outputs]
    for lp, before in zip(returned, current):
        np.testing.assert_allclose(lp, before, atol=1e-5)  # no optimizer step: the weights are unchanged
    effective = {**DEFAULTS.get(loss_fn, {}), **(config or {})}
    expected = reference_loss(loss_fn, returned, inputs, effective)
    assert output.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    if config:  # the keys changed the result: they were read, not just accepted
        assert abs(expected - reference_loss(loss_fn, returned, inputs, DEFAULTS[loss_fn])) > 1e-3


def test_cross_entropy_with_signed_weights(rig):
    training, sequences, current = rig
    rng = np.random.default_rng(1)
    data, inputs = [], []
    for prompt, completion in sequences:
        tokens = prompt + completion
        row = {
            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
            "weights": rng.normal(size=len(tokens) - 1).astype(np.float32),
        }
        inputs.append(row)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={k: v.tolist() for k, v in row.items()},
            )
        )
    output = training.forward_backward(data, "cross_entropy").result()
    returned = [out["logprobs"].to_numpy() for out in output.loss_fn_outputs]
    assert output.metrics["loss:sum"] == pytest.approx(
        reference_loss("cross_entropy", returned, inputs, {}), rel=1e-4, abs=1e-4
    )


def test_per_token_clip_thresholds_override_the_config(rig):
    training, sequences, current = rig
    data, inputs = rl_batch(sequences, current, with_mask=False)
    for datum, row in zip(data, inputs):
        n = len(row["target_tokens"])
        row["clip_low_threshold"] = np.full(n, 0.95, dtype=np.float32)
        row["clip_high_threshold"] = np.linspace(1.0, 1.3, n).astype(np.float32)
        datum.loss_fn_inputs["clip_low_threshold"] = types.TensorData.from_numpy(row["clip_low_threshold"])
        datum.loss_fn_inputs["clip_high_threshold"] = types.TensorData.from_numpy(row["clip_high_threshold"])
    output = training.forward_backward(data, "ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}).result()
    returned = [out["logprobs"].to_numpy() for out in output.loss_fn_outputs]
    assert output.metrics["loss:sum"] == pytest.approx(reference_loss("ppo", returned, inputs, {}), rel=1e-4, abs=1e-4)


def test_a_config_key_the_loss_does_not_use_is_refused(rig):
    training, sequences, current = rig
    data, _ = rl_batch(sequences, current, with_mask=False)
    with pytest.raises(tinker.BadRequestError, match="not used by 'ppo'.*clip_high_threshold"):
        training.forward_backward(data, "ppo", {"beta": 0.1}).result()


def test_forward_backward_custom_takes_the_cross_entropy_step(sdk_env):
    """A weighted NLL computed client-side moves the weights exactly as cross_entropy does."""
    service = tinker.ServiceClient()
    custom, builtin = (service.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result() for _ in range(2))
    tokenizer = custom.get_tokenizer()
    scales = (1.0, -0.5, 2.0)
    data, scaled = [], []
    for (prompt, completion), scale in zip(zip(PROMPTS, COMPLETIONS), scales):
        tokens = tokenizer.encode(prompt + completion)
        weights = np.linspace(0.0, 1.0, len(tokens) - 1, dtype=np.float32)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights.tolist()},
            )
        )
        scaled.append(
            types.Datum(
                model_input=data[-1].model_input,
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": (weights * scale).tolist()},
            )
        )

    def weighted_nll(batch, logprobs_list):
        loss = sum(
            -(lp * datum.loss_fn_inputs["weights"].to_torch() * s).sum()
            for datum, lp, s in zip(batch, logprobs_list, scales)
        )
        return loss, {"custom/tokens:sum": float(sum(lp.numel() for lp in logprobs_list))}

    adam = types.AdamParams(learning_rate=1e-2)
    custom_out = custom.forward_backward_custom(data, weighted_nll)
    custom_step = custom.optim_step(adam)
    builtin_out = builtin.forward_backward(scaled, "cross_entropy")
    builtin_step = builtin.optim_step(adam)
    custom_result, builtin_result = custom_out.result(), builtin_out.result()
    custom_step.result(), builtin_step.result()

    logprobs = [torch.tensor(out["logprobs"].to_numpy()) for out in builtin_result.loss_fn_outputs]
    expected = float(weighted_nll(data, logprobs)[0])
    assert custom_result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    assert builtin_result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    assert custom_result.metrics["custom/tokens:sum"] == sum(len(d.loss_fn_inputs["weights"].data) for d in data)
    after = [
        [out["logprobs"].to_numpy() for out in client.forward(data, "cross_entropy").result().loss_fn_outputs]
        for client in (custom, builtin)
    ]
    for a, b, before in zip(after[0], after[1], logprobs):
        np.testing.assert_allclose(a, b, atol=1e-6)
        assert not np.allclose(a, before.numpy(), atol=1e-4)  # the step did move the weights
    close_service(service)
