"""A full fine-tuning run sharded over two FSDP2 ranks (`OPENRL_TRAINER_FULL_SHARDS=2`, gloo on
CPU) behind `openrl serve`, driven by the real tinker SDK on the tiny model: save_state writes
sharded checkpoints, load_state and a fork read them back bitwise (the store's sha256 of
every file) while the runs park in turn under the timeslicer's budget, and the sampler gets
the gathered weights. The rank-loss recovery is in
test_sharded_recovery.py (it needs a trainer process of its own to end).
"""

from __future__ import annotations

import pytest
import tinker
from tinker import types

from functions.local_server import LocalServer
from tests.e2e.test_run_fork import datums, fork, state_files, train
from tests.e2e.test_shared_accelerator import device

pytestmark = pytest.mark.e2e

MODEL = "openrl/tiny-qwen3"
KEY = "tml-sharded-alice"
FULL = {"openrl.full_finetune": "true"}
SHARDS = {"shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors", "openrl_full.json", "optimizer.json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A sharded run of the tiny Qwen3 is 20M parameters x 16 bytes / 2 ranks = 160 MB a device:
    # the budget holds the sampler's base and one such run, not two, so the runs park in turn.
    env = {"OPENRL_SNAPSHOT_EVERY_STEPS": "2", "OPENRL_TRAINER_FULL_SHARDS": "2", "TINKER_TELEMETRY": "0",
           "OPENRL_ACCELERATOR_MEMORY": "300MiB"}  # fmt: skip
    with LocalServer(tmp_path_factory.mktemp("openrl-sharded"), [MODEL], f"alice={KEY}", extra_env=env) as srv:
        yield srv


def test_a_sharded_full_run_saves_loads_forks_and_samples(server, capsys, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    training = service.create_lora_training_client(base_model=MODEL, user_metadata=FULL).result()
    first = train(training, range(2))
    at2 = training.save_state("at-2").result().path
    later = train(training, range(2, 4))
    at4 = training.save_state("at-4").result().path
    assert set(state_files(server, at2)) == SHARDS
    assert len(set(first + later)) == 4  # it trains: every step's loss differs

    # load_state: the same two steps from the step-2 checkpoint end in the same files, bitwise,
    # while the first run, parked to make room (every rank its own shards), waits.
    resumed = service.create_training_client_from_state_with_optimizer(at2).result()
    assert train(resumed, range(2, 3)) == later[:1]
    at3 = resumed.save_state("resumed-3").result().path
    assert train(resumed, range(3, 4)) == later[1:]
    assert state_files(server, resumed.save_state("resumed-4").result().path) == state_files(server, at4)

    # A fork at step 3, rebuilt on the sharded engine from the step-2 snapshot and step 3's two
    # requests replayed, is the step-3 state.
    code, forked = fork(server, capsys, training.model_id, 3, key=KEY)
    assert code == 0 and forked["rebuilt_from"] == {"snapshot_step": 2, "replayed_requests": 2}, forked
    assert state_files(server, forked["tinker_path"]) == state_files(server, at3)

    # The sampler gets the gathered weights: greedy samples are reproducible and come back whole.
    sampler = training.save_weights_and_get_sampling_client("sharded-sampler")
    prompt = types.ModelInput.from_ints(datums(9)[0].model_input.to_ints())
    params = types.SamplingParams(max_tokens=6, temperature=0.0)
    a = sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0]
    b = sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0]
    assert len(a.tokens) == 6 and a.tokens == b.tokens
    status = device(server)
    assert status["parks"] >= 2 and status["restores"] >= 1 and status["resident_bytes"] <= status["budget_bytes"], (
        status
    )
    assert "parked" in server.log_tail()
