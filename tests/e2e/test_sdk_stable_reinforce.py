"""`stable_reinforce` through the real SDK 0.38: sample with `record_stability_info=True`,
name the sequences in provenance spans (as `tinker_cookbook.recipes.rl_loop` does), train.

The server's `loss:sum` equals a float64 reference computed here from the logprobs the
trainer returned and the sampler's logprobs the SDK received (temperature 1, so the
distribution each token was drawn from is the raw one the sampler reports), with the
datum's own `logprobs` input set to garbage: the loss reads the server's records. Refused
with a 400 that says why: a datum without provenance, a sequence sampled without
records, a token that differs from the record, an advantage on a prompt row, a sequence of
another tenant (as if unknown) or of another session. The records are in the event store:
a server stopped and started again between sampling and training still trains on them.
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from functions.local_server import LocalServer
from tests.e2e.conftest import API_KEY, OTHER_KEY
from tests.e2e.sdk_close import close_service

pytestmark = pytest.mark.e2e

MODEL = "openrl/tiny-qwen3"
PROMPT = [9707, 11, 1879, 0, 3555, 374, 279]
ADVANTAGES = (1.0, -0.5, 0.75)
SAMPLING = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0)


def datum(prompt, sequence, advantage, client_logprobs=None):
    """`rl_loop`'s datum and its `with_sampled_provenance` spans."""
    tokens, ob = list(sequence.tokens), len(prompt) - 1
    logprobs = client_logprobs if client_logprobs is not None else [0.0] * ob + list(sequence.logprobs)
    return types.Datum(
        model_input=types.ModelInput.from_ints(prompt + tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": [0] * ob + tokens,
            "logprobs": logprobs,
            "advantages": [0.0] * ob + [advantage] * len(tokens),
        },
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, length=len(prompt)),
            types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=len(tokens) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, offset=1, length=ob),
            types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=len(tokens)),
        ],
    )


def sample(training, record=True):
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=record).result()
    response = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=3, sampling_params=SAMPLING).result()
    assert all(len(s.tokens) >= 2 for s in response.sequences)
    return response.sequences


def reference(output, sequences, config) -> float:
    """Sum over sampled rows of -min(u, cap) * A * lp + kl * (u - 1 - log u), u = exp(lp - mu)."""
    total = 0.0
    for out, sequence, advantage in zip(output.loss_fn_outputs, sequences, ADVANTAGES):
        lp = out["logprobs"].to_numpy().astype(np.float64)[len(PROMPT) - 1 :]
        mu = np.asarray(sequence.logprobs, dtype=np.float64)
        u = np.exp(lp - mu)
        total += float(np.sum(-np.minimum(u, config["cap"]) * advantage * lp + config["kl"] * (u - 1 - (lp - mu))))
    return total


@pytest.fixture(scope="module")
def alice(server):
    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    yield service, training
    close_service(service)


@pytest.mark.parametrize("config", [None, {"kl_coeff": 0.5, "clip_high_threshold": 1.5}])
def test_the_loss_trains_on_the_recorded_samples(alice, config):
    _service, training = alice
    sequences = sample(training)
    assert len({s.sequence_id for s in sequences}) == 3
    garbage = [[-7.0] * (len(PROMPT) - 1 + len(s.tokens)) for s in sequences]
    data = [datum(PROMPT, s, a, g) for s, a, g in zip(sequences, ADVANTAGES, garbage)]
    output = training.forward_backward(data, "stable_reinforce", config).result()
    resolved = {"cap": (config or {}).get("clip_high_threshold", 2.0), "kl": (config or {}).get("kl_coeff", 0.0)}
    assert output.metrics["loss:sum"] == pytest.approx(reference(output, sequences, resolved), rel=1e-4, abs=1e-4)
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_what_the_records_do_not_back_is_refused(alice, server):
    service, training = alice
    sequences = sample(training)
    bare = types.Datum(
        model_input=datum(PROMPT, sequences[0], 1.0).model_input,
        loss_fn_inputs=datum(PROMPT, sequences[0], 1.0).loss_fn_inputs,
    )
    with pytest.raises(tinker.BadRequestError, match="no provenance spans.*record_stability_info=true"):
        training.forward_backward([bare], "stable_reinforce").result()
    unrecorded = sample(training, record=False)
    with pytest.raises(tinker.BadRequestError, match="sampled without record_stability_info=true"):
        training.forward_backward([datum(PROMPT, unrecorded[0], 1.0)], "stable_reinforce").result()
    swapped = datum(PROMPT, sequences[0], 1.0)
    targets = list(swapped.loss_fn_inputs["target_tokens"].data)
    targets[-1] = (targets[-1] + 1) % 1000
    changed = types.Datum(
        model_input=swapped.model_input,
        loss_fn_inputs={**swapped.loss_fn_inputs, "target_tokens": targets},
        model_input_spans=swapped.model_input_spans,
        loss_fn_input_spans=swapped.loss_fn_input_spans,
    )
    with pytest.raises(tinker.BadRequestError, match="does not reproduce the recorded sample"):
        training.forward_backward([changed], "stable_reinforce").result()
    advantages = [0.5] + [1.0] * (len(PROMPT) - 2 + len(sequences[0].tokens))
    on_prompt = types.Datum(
        model_input=swapped.model_input,
        loss_fn_inputs={**swapped.loss_fn_inputs, "advantages": advantages},
        model_input_spans=swapped.model_input_spans,
        loss_fn_input_spans=swapped.loss_fn_input_spans,
    )
    with pytest.raises(tinker.BadRequestError, match="non-zero at row 0, which no sampled provenance span backs"):
        training.forward_backward([on_prompt], "stable_reinforce").result()
    # another session of the same tenant: its training request may not name alice's samples
    other_session = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    try:
        elsewhere = other_session.create_lora_training_client(base_model=MODEL, rank=4).result()
        with pytest.raises(tinker.BadRequestError, match="can only name sequences sampled in its own session"):
            elsewhere.forward_backward([datum(PROMPT, sequences[0], 1.0)], "stable_reinforce").result()
    finally:
        close_service(other_session)
    # another tenant: exactly as if the sequence did not exist
    bob = tinker.ServiceClient(base_url=server.url, api_key=OTHER_KEY)
    try:
        theirs = bob.create_lora_training_client(base_model=MODEL, rank=4).result()
        with pytest.raises(tinker.BadRequestError, match="is no sampled sequence of this tenant"):
            theirs.forward_backward([datum(PROMPT, sequences[0], 1.0)], "stable_reinforce").result()
    finally:
        close_service(bob)


def test_the_records_survive_a_restart(tmp_path):
    server = LocalServer(tmp_path / "data", [MODEL], f"alice={API_KEY}")
    try:
        server.wait_ready()
        service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
        training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
        sequences = sample(training)
        server.stop()
        server.start()
        server.wait_ready()
        data = [datum(PROMPT, s, a) for s, a in zip(sequences, ADVANTAGES)]
        output = training.forward_backward(data, "stable_reinforce").result()
        assert output.metrics["loss:sum"] == pytest.approx(
            reference(output, sequences, {"cap": 2.0, "kl": 0.0}), rel=1e-4, abs=1e-4
        )
        close_service(service)
    finally:
        server.stop()
