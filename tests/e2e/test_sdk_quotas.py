"""The real tinker SDK against a server whose tenant alice may have one request in flight:
her pipelined forward_backward + optim_step meet a 429 on the second, the SDK retries it
(same seq_id) after the Retry-After, and both finish once the first completes, with the
same numbers as without the limit (bob, unlimited, runs the same step alongside)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tinker
from tinker import types

from functions.local_server import LocalServer

pytestmark = pytest.mark.e2e
MODEL = "openrl/tiny-qwen3"
ALICE, BOB = "tml-quota-alice", "tml-quota-bob"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_files):
    with LocalServer(
        tmp_path_factory.mktemp("openrl-quotas"), [MODEL], f"alice={ALICE},bob={BOB}",
        extra_env={"OPENRL_TENANT_QUOTAS": json.dumps({"alice": {"requests_in_flight": 1}})},
    ) as srv:  # fmt: skip
        yield srv


def data() -> list[types.Datum]:
    rng = np.random.default_rng(0)
    rows = [rng.integers(100, 5000, size=9).tolist() for _ in range(2)]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * 8},
        )
        for r in rows
    ]


def step(server, key: str):
    client = tinker.ServiceClient(base_url=server.url, api_key=key)
    training = client.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
    # Both submitted before either is awaited: with a limit of one in flight the second waits.
    fwdbwd = training.forward_backward(data(), "cross_entropy")
    optim = training.optim_step(types.AdamParams(learning_rate=1e-2))
    loss = fwdbwd.result(timeout=120).metrics["loss:sum"]
    optim.result(timeout=120)
    after = training.forward(data(), "cross_entropy").result(timeout=120).metrics["loss:sum"]
    return loss, after


def test_the_sdk_retries_a_429_with_the_same_seq_id_until_capacity_frees(server, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    limited = step(server, ALICE)
    free = step(server, BOB)
    assert limited == pytest.approx(free, rel=1e-6)  # the refused seq_id was not skipped: same training
    refusals = [line for line in server.log_path.read_text().splitlines() if "quota: tenant" in line]
    assert refusals and all("tenant alice refused (429, requests_in_flight" in line for line in refusals), refusals
