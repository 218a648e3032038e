"""The real tinker SDK against `openrl serve --sampler-engine vllm`, compared with the same
calls on the torch-engine server of the e2e session: a LoRA run trained identically on
both (seeded, CPU training is deterministic), then greedy samples of the base model and of
the published adapter in one batch, and prompt logprobs; and a full fine-tuning run whose
weights reach the sampler as a full checkpoint, then as a delta. Tokens must be identical
and logprobs within 1e-4 (float32 on both engines).

Skipped only when the vLLM venv (`OPENRL_VLLM_ENV`, else `.venv-vllm`) is absent (`make
vllm`; `make test` builds it).
"""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import pytest
import tinker
from tinker import types

from functions.local_server import LocalServer
from functions.sampler.vllm_engine import DEFAULT_ENV
from tests.e2e.conftest import API_KEY
from tests.e2e.sdk_close import close_service

# The venv the servers' engine will use: OPENRL_VLLM_ENV (which they inherit), else .venv-vllm.
VLLM_ENV = Path(os.environ.get("OPENRL_VLLM_ENV") or DEFAULT_ENV)
pytestmark = [
    # The vLLM engine starts in ~40 s alone here and over a minute beside another busy
    # test worker; two such starts plus the torch server sessions need more than the default.
    pytest.mark.timeout(900),
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (VLLM_ENV / "bin" / "python").exists(), reason=f"no vLLM venv at {VLLM_ENV}: run `make vllm`"
    ),
]
MODEL = "openrl/tiny-qwen3"
PROMPT = [785, 3974, 13876, 38835, 13, 40, 1079]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    srv = LocalServer(
        tmp_path_factory.mktemp("openrl-vllm"), [MODEL], f"alice={API_KEY}", extra_env={"OPENRL_SAMPLER_ENGINE": "vllm"}
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def run_session(url: str, api_key: str = API_KEY) -> dict:
    """A LoRA run trained 2 steps, then base and adapter greedy samples and the adapter's
    prompt logprobs, sent together (the distributed suite reuses it)."""
    service = tinker.ServiceClient(base_url=url, api_key=api_key)
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result()
    tokens = PROMPT + [11, 1221, 4128]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    for _ in range(2):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    tuned = training.save_weights_and_get_sampling_client().result()
    base = service.create_sampling_client(base_model=MODEL).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    # Sent together, so the sampler takes base and adapter rows into one batch.
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = {
            "base": pool.submit(lambda: base.sample(prompt, 2, params).result()),
            "tuned": pool.submit(lambda: tuned.sample(prompt, 1, params).result()),
            "logprobs": pool.submit(lambda: tuned.compute_logprobs(prompt).result()),
        }
        out = {name: future.result() for name, future in futures.items()}
    close_service(service)
    return out


def test_vllm_server_samples_like_the_torch_server(vllm_server, sdk_env):
    got, want = run_session(vllm_server.url), run_session(sdk_env.url)
    assert f"vLLM engine for {MODEL} ready" in vllm_server.log_path.read_text()  # not the torch engine
    check_sessions_match(got, want)


def check_sessions_match(got: dict, want: dict) -> None:
    """`run_session` on vLLM (`got`) against the torch engine: same greedy tokens, logprobs
    within TOLERANCE, and the adapter really changes what is sampled."""
    for name in ("base", "tuned"):
        assert len(got[name].sequences) == len(want[name].sequences)
        for g, w in zip(got[name].sequences, want[name].sequences):
            assert g.tokens == w.tokens
            assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < TOLERANCE
    assert got["tuned"].sequences[0].tokens != got["base"].sequences[0].tokens or (
        got["tuned"].sequences[0].logprobs != got["base"].sequences[0].logprobs
    )
    assert got["logprobs"][0] is None and want["logprobs"][0] is None
    assert max(abs(a - b) for a, b in zip(got["logprobs"][1:], want["logprobs"][1:])) < TOLERANCE


def full_session(url: str) -> list:
    """A full fine-tuning run: sample after its first publication (a full checkpoint) and
    after its second (a delta against the first)."""
    service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    training = service.create_lora_training_client(
        base_model=MODEL, user_metadata={"openrl.full_finetune": "true"}
    ).result()
    tokens = PROMPT + [11, 1221, 4128]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    out = []
    for _ in range(2):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        out.append(sampler.sample(prompt, 1, params).result().sequences[0])
    close_service(service)
    return out


def test_full_finetuned_weights_sample_like_the_torch_server(vllm_server, sdk_env):
    got, want = full_session(vllm_server.url), full_session(sdk_env.url)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < TOLERANCE
    assert got[0].logprobs != got[1].logprobs  # the second publication really changed the weights


def test_stable_reinforce_trains_on_the_vllm_engines_records(vllm_server):
    """Sampled on vLLM with record_stability_info (temperature 1), trained with stable_reinforce:
    loss:sum equals the reference from the returned logprobs and vLLM's own logprobs."""
    from tests.e2e.test_sdk_stable_reinforce import ADVANTAGES, datum, reference, sample
    from tests.e2e.test_sdk_stable_reinforce import PROMPT as RECORDED_PROMPT

    service = tinker.ServiceClient(base_url=vllm_server.url, api_key=API_KEY)
    try:
        training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
        sequences = sample(training)
        data = [datum(RECORDED_PROMPT, s, a) for s, a in zip(sequences, ADVANTAGES)]
        output = training.forward_backward(data, "stable_reinforce").result()
        assert output.metrics["loss:sum"] == pytest.approx(
            reference(output, sequences, {"cap": 2.0, "kl": 0.0}), rel=1e-4, abs=1e-4
        )
        tempered = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
        with pytest.raises(tinker.RequestFailedError, match="needs temperature 1"):
            tempered.sample(
                types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2, temperature=0.7)
            ).result()
    finally:
        close_service(service)
