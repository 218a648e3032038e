"""Dimuon through the real SDK against a live `openrl serve` (snapshots every 2 steps):
`DimuonOptimizerConfig` at creation, `DimuonParams` per step, and the state surviving
save_state / create_training_client_from_state_with_optimizer and a fork rebuilt from a
snapshot plus replay, bitwise (states compared by their files' sha256 in the store, as
tests/e2e/test_run_fork.py does). The update itself is tested against a reference in
tests/functions/trainer/test_dimuon.py; parking and recovery by replay there and in
tests/functions/trainer/test_recovery.py."""

from __future__ import annotations

import json
import random

import httpx
import pytest
import tinker
from sqlalchemy import create_engine, select
from tinker import types

from eventing.store import tables
from functions import cli
from functions.local_server import LocalServer

pytestmark = pytest.mark.e2e

MODEL = "openrl/tiny-qwen3"
KEY = "tml-dimuon-alice"
RATES = [1e-2, 2e-2, 1.5e-2, 3e-2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LocalServer(
        tmp_path_factory.mktemp("openrl-dimuon"), [MODEL], f"alice={KEY}",
        extra_env={"OPENRL_SNAPSHOT_EVERY_STEPS": "2", "TINKER_TELEMETRY": "0"},
    ) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def service(server):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TINKER_TELEMETRY", "0")
        yield tinker.ServiceClient(base_url=server.url, api_key=KEY)


def datums(step: int) -> list[types.Datum]:
    rng = random.Random(step)
    out = []
    for length in (9, 6):
        tokens = [rng.randrange(1, 5000) for _ in range(length + 1)]
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length}))  # fmt: skip
    return out


def train(client, steps) -> list[float]:
    losses = []
    for step in steps:
        losses.append(client.forward_backward(datums(step), "cross_entropy").result().metrics["loss:sum"])
        params = types.DimuonParams(learning_rate=RATES[step], beta1=0.8, grad_clip_norm=1.0)
        metrics = client.optim_step(params).result().metrics
        assert metrics["optim/lr"] == pytest.approx(RATES[step]) and metrics["optim/grad_norm"] > 0
    return losses


def state_files(server, path: str) -> dict[str, str]:
    run_id, checkpoint_id = path[len("tinker://") :].split("/", 1)
    engine = create_engine(f"sqlite:///{server.data_dir / 'events.db'}")
    with engine.connect() as conn:
        files = conn.execute(
            select(tables.checkpoints.c.files).where(
                tables.checkpoints.c.run_id == run_id, tables.checkpoints.c.checkpoint_id == checkpoint_id
            )
        ).scalar()
    engine.dispose()
    assert files, f"no checkpoint {path}"
    return {name: ref["sha256"] for name, ref in files.items()}


def test_dimuon_trains_and_its_state_survives_save_load_and_fork(server, service, capsys):
    parent = service.create_lora_training_client(
        base_model=MODEL, rank=4, seed=7, optimizer=types.DimuonOptimizerConfig()
    ).result()
    losses = train(parent, [0, 1, 2, 0])  # step 3 repeats step 0's data: the loss must have dropped
    assert losses[3] < losses[0]
    at4 = parent.save_state("at-4").result().path
    files = state_files(server, at4)
    assert set(files) == {"adapter_model.safetensors", "adapter_config.json", "optimizer.safetensors", "optimizer.json"}

    # a fork at step 3: the snapshot after step 2, then step 3 replayed; then both make step 4
    capsys.readouterr()
    code = cli.main(
        ["runs", "fork", parent.model_id, "--at-step", "3", "--json", "--url", server.url, "--api-key", KEY]
    )
    forked = json.loads(capsys.readouterr().out)
    assert code == 0 and forked["status"] == "ready", forked
    assert forked["rebuilt_from"] == {"snapshot_step": 2, "replayed_requests": 2}
    stopped = service.create_lora_training_client(
        base_model=MODEL, rank=4, seed=7, optimizer=types.DimuonOptimizerConfig()
    ).result()
    train(stopped, [0, 1, 2])
    at3 = stopped.save_state("at-3").result().path
    assert state_files(server, forked["tinker_path"]) == state_files(server, at3)

    # save_state -> create_training_client_from_state_with_optimizer: continues as the parent does
    loaded = service.create_training_client_from_state_with_optimizer(at4).result()
    assert train(loaded, [3]) == train(parent, [3])
    assert state_files(server, loaded.save_state("l5").result().path) == state_files(
        server, parent.save_state("p5").result().path
    )

    # the other family's step is refused (the future fails with the reason), nothing applied
    with pytest.raises(Exception, match="dimuon optimizer .* needs DimuonParams"):
        parent.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    adam = service.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
    with pytest.raises(Exception, match="adamw optimizer .* needs AdamParams"):
        adam.optim_step(types.DimuonParams(learning_rate=1e-3)).result()


def test_bad_dimuon_input_is_a_clear_400(server, service):
    headers = {"X-API-Key": KEY}
    made = httpx.post(f"{server.url}/api/v1/create_session", json={"tags": [], "user_metadata": {}}, headers=headers)
    create = {
        "session_id": made.json()["session_id"],
        "model_seq_id": 90,
        "base_model": MODEL,
        "lora_config": {"rank": 4},
    }
    for config, fragment in (({"type": "dimuon", "version": 2}, "not one this server knows"),
                             ({"type": "lion"}, "'lion' is not offered")):  # fmt: skip
        answer = httpx.post(f"{server.url}/api/v1/create_model", json={**create, "optimizer_config": config},
                            headers=headers)  # fmt: skip
        assert answer.status_code == 400 and fragment in answer.json()["detail"], answer.text
    full = {**create, "user_metadata": {"openrl.full_finetune": "true"}, "optimizer_config": {"type": "dimuon"}}
    answer = httpx.post(f"{server.url}/api/v1/create_model", json=full, headers=headers)
    assert answer.status_code == 400 and "full fine-tuning trains with 'adamw'" in answer.json()["detail"], answer.text
    client = service.create_lora_training_client(base_model=MODEL, rank=4, optimizer=types.DimuonOptimizerConfig())
    client = client.result()
    step = {"model_id": client.model_id, "seq_id": 1, "optimizer_params": {"type": "dimuon", "learning_rate": -1}}
    answer = httpx.post(f"{server.url}/api/v1/optim_step", json=step, headers=headers)
    assert answer.status_code == 400 and "DimuonParams: learning_rate" in answer.json()["detail"], answer.text
