"""A run left idle is released from the trainer's memory and resumes bitwise, through the SDK.

`openrl serve` with `OPENRL_TRAINER_RELEASE_RUNS_AFTER_S=1`: run A trains two steps, sends
nothing until the server's log says it released A (after a snapshot of it), then trains two
more; run B (same seed, same data) trains its four steps straight. The trainer restored A
from its snapshot on A's next request, so every loss A reports, and a forward pass after the
last step, equal B's bit for bit. The same for two full fine-tuning runs, whose samplers
(fed by weight deltas, and by a full version after A's restore) then sample alike.
"""

from __future__ import annotations

import re
import time

import pytest
import tinker
from tinker import types

from functions.local_server import LocalServer

pytestmark = pytest.mark.e2e
MODEL = "openrl/tiny-qwen3"
KEY = "tml-idle"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LocalServer(
        tmp_path_factory.mktemp("openrl-idle"), [MODEL], f"alice={KEY}",
        extra_env={"TINKER_TELEMETRY": "0", "OPENRL_TRAINER_RELEASE_RUNS_AFTER_S": "1", "OPENRL_SNAPSHOT_EVERY_STEPS": "100"},
    ) as srv:  # fmt: skip
        yield srv


def datum(offset: int) -> types.Datum:
    tokens = list(range(100 + offset, 117 + offset))
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def step(training, index: int) -> float:
    fb = training.forward_backward([datum(index)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return fb.metrics["loss:sum"]


def released(server, model_id: str, within: float = 60.0) -> bool:
    pattern = re.compile(rf"released {re.escape(model_id)} after")
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if pattern.search(server.log_path.read_text()):
            return True
        time.sleep(0.2)
    return False


def test_a_released_run_resumes_bitwise_like_a_run_never_released(server):
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    a = service.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
    b = service.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
    losses_a = [step(a, 0), step(a, 1)]
    assert released(server, a.model_id), server.log_tail()
    losses_a += [step(a, 2), step(a, 3)]
    losses_b = [step(b, i) for i in range(4)]
    assert losses_a == losses_b  # bitwise: floats compared exactly
    assert losses_a[3] != losses_a[1]  # and the steps really changed the weights
    after_a = a.forward([datum(4)], "cross_entropy").result().metrics["loss:sum"]
    after_b = b.forward([datum(4)], "cross_entropy").result().metrics["loss:sum"]
    assert after_a == after_b
    assert re.search(rf"restored {re.escape(a.model_id)} from its snapshot", server.log_path.read_text())


def test_a_released_full_finetuning_run_resumes_and_publishes_like_one_never_released(server):
    """A full run's weights and optimizer come back from the snapshot, and its samplers (whose
    weights follow it by deltas against the last published version) sample as B's do."""
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    full = {"openrl.full_finetune": "true"}
    a = service.create_lora_training_client(base_model=MODEL, user_metadata=full).result()
    b = service.create_lora_training_client(base_model=MODEL, user_metadata=full).result()
    prompt = types.ModelInput.from_ints([785, 3974, 13876, 38835])
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])

    def trained(training, index: int):
        loss = step(training, index)
        sample = (
            training.save_weights_and_get_sampling_client().result().sample(prompt, 1, greedy).result().sequences[0]
        )
        return loss, sample.tokens, sample.logprobs

    runs_a = [trained(a, 0)]
    assert released(server, a.model_id), server.log_tail()
    runs_a += [trained(a, 1), trained(a, 2)]
    runs_b = [trained(b, i) for i in range(3)]
    assert runs_a == runs_b
    assert runs_a[2][0] != runs_a[0][0]
