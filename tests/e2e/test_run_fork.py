"""Forking a run at a step (`openrl runs fork`, `POST /api/openrl/v1/runs/{id}/fork`) against a
live `openrl serve` that snapshots every 2 steps, driven by the real tinker SDK on the tiny
model. Bitwise on CPU: a fork's weights and optimizer state equal a run that was stopped at
that step, and both continue identically, whether the fork was rebuilt from a snapshot plus
replayed requests, from the run's creation plus replay, or from a snapshot alone.

States are compared through the store: a checkpoint's files are content-addressed blobs, so
two checkpoints hold bitwise the same state exactly when their files have the same sha256.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import httpx
import pytest
import tinker
from sqlalchemy import create_engine, select, text
from tinker import types
from tinker.lib.public_interfaces.training_client import TrainingClient, fetch_training_info

from eventing.store import tables
from functions import cli
from functions.local_server import REPO, LocalServer
from openrl_core.events.training import FORK
from tests.e2e.sdk_close import close_service

pytestmark = pytest.mark.e2e

MODEL = "openrl/tiny-qwen3"
ALICE, BOB = "tml-fork-alice", "tml-fork-bob"
RATES = [1e-3, 2e-3, 1.5e-3, 3e-3, 1e-3, 2.5e-3, 2e-3]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LocalServer(
        tmp_path_factory.mktemp("openrl-fork"), [MODEL], f"alice={ALICE},bob={BOB}",
        extra_env={"OPENRL_SNAPSHOT_EVERY_STEPS": "2", "TINKER_TELEMETRY": "0"},
    ) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def alice(server):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TINKER_TELEMETRY", "0")
        client = tinker.ServiceClient(base_url=server.url, api_key=ALICE)
        yield client


def datums(step: int) -> list[types.Datum]:
    """Two short sequences of token ids, different every step."""
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
        client.optim_step(types.AdamParams(learning_rate=RATES[step])).result()
    return losses


def state_files(server, path: str) -> dict[str, str]:
    """A checkpoint's files as the store records them: name -> sha256 of the content."""
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


def fork(server, capsys, run_id: str, step: int, key: str = ALICE) -> tuple[int, dict]:
    capsys.readouterr()
    code = cli.main(["runs", "fork", run_id, "--at-step", str(step), "--json", "--url", server.url, "--api-key", key])
    return code, json.loads(capsys.readouterr().out)


def drive(service, model_id: str) -> TrainingClient:
    """A TrainingClient of the SDK on an existing run (the fork itself), from seq_id 1."""
    holder = service.holder
    info = holder.run_coroutine_threadsafe(fetch_training_info(holder, model_id)).result()
    return TrainingClient(holder, model_seq_id=0, model_id=model_id, info=info)


@pytest.fixture(scope="module")
def parent(alice):
    """Six LoRA steps, varying data and learning rate; the state saved after steps 3 and 6."""
    training = alice.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
    train(training, range(3))
    at3 = training.save_state("at-3").result().path
    train(training, range(3, 6))
    at6 = training.save_state("at-6").result().path
    return {"client": training, "at3": at3, "at6": at6}


def test_a_fork_is_bitwise_a_run_stopped_at_that_step_and_continues_identically(server, alice, parent, capsys):
    run_id = parent["client"].model_id
    code, forked = fork(server, capsys, run_id, 3)
    assert code == 0 and forked["schema"] == "openrl.fork.v1" and forked["status"] == "ready", forked
    assert forked["forked_from"] == {"run": run_id, "step": 3} and forked["run_id"] != run_id
    # The snapshot after step 2, then step 3's forward_backward and optim_step replayed.
    assert forked["rebuilt_from"] == {"snapshot_step": 2, "replayed_requests": 2}
    assert forked["tinker_path"] == f"tinker://{forked['run_id']}/weights/forked-at-step-3"

    stopped = alice.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
    train(stopped, range(3))
    stopped_state = stopped.save_state("stopped-at-3").result().path
    fork_state = state_files(server, forked["tinker_path"])
    assert set(fork_state) == {
        "adapter_model.safetensors",
        "adapter_config.json",
        "optimizer.safetensors",
        "optimizer.json",
    }
    assert fork_state == state_files(server, stopped_state) == state_files(server, parent["at3"])
    assert fork_state["adapter_model.safetensors"] != state_files(server, parent["at6"])["adapter_model.safetensors"]

    # Step 4 on the stopped run, on the fork itself, and on a run loaded from the fork's path.
    loaded = alice.create_training_client_from_state_with_optimizer(forked["tinker_path"]).result()
    direct = drive(alice, forked["run_id"])
    losses = [train(client, [3]) for client in (stopped, direct, loaded)]
    assert losses[0] == losses[1] == losses[2]
    after = [state_files(server, client.save_state("after-4").result().path) for client in (stopped, direct, loaded)]
    assert after[0] == after[1] == after[2] and after[0] != fork_state

    shown = httpx.get(f"{server.url}/api/openrl/v1/runs/{forked['run_id']}", headers={"X-API-Key": ALICE}).json()["run"]
    assert (
        shown["forked_from"] == {"run": run_id, "step": 3} and shown["status"] == "active" and shown["lora_rank"] == 4
    )
    capsys.readouterr()
    assert cli.main(["runs", "show", forked["run_id"], "--url", server.url, "--api-key", ALICE]) == 0
    assert f"forked_from             {run_id} at step 3" in capsys.readouterr().out
    listed = httpx.get(f"{server.url}/api/openrl/v1/runs", headers={"X-API-Key": ALICE}).json()["runs"]
    assert {r["run_id"]: r["forked_from"] for r in listed}[run_id] is None


def test_fork_at_step_0_and_at_the_last_step(server, alice, parent, capsys):
    run_id = parent["client"].model_id
    code, last = fork(server, capsys, run_id, 6)
    assert code == 0 and last["status"] == "ready"
    # The snapshot after step 6 if it was stored by then, else the one after step 4 plus replay.
    assert last["rebuilt_from"] in (
        {"snapshot_step": 6, "replayed_requests": 0},
        {"snapshot_step": 4, "replayed_requests": 4},
    )
    assert state_files(server, last["tinker_path"]) == state_files(server, parent["at6"])

    code, first = fork(server, capsys, run_id, 0)
    assert code == 0 and first["rebuilt_from"] == {"snapshot_step": None, "replayed_requests": 0}
    fresh = alice.create_lora_training_client(base_model=MODEL, rank=4, seed=7).result()
    assert state_files(server, first["tinker_path"]) == state_files(server, fresh.save_state("fresh").result().path)


def test_the_table_answer_and_a_retried_fork(server, parent, capsys):
    run_id = parent["client"].model_id
    capsys.readouterr()
    assert cli.main(["runs", "fork", run_id, "--at-step", "2", "--url", server.url, "--api-key", ALICE]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"forked {run_id} at step 2 as ") and lines[1].startswith(
        "state (weights and optimizer): tinker://"
    )
    assert "create_training_client_from_state_with_optimizer('tinker://" in lines[2]

    api = httpx.Client(
        base_url=f"{server.url}/api/openrl/v1", headers={"X-API-Key": ALICE, "X-Idempotency-Key": "retry-me"}
    )
    first = api.post(f"/runs/{run_id}/fork", json={"step": 1}).json()
    again = api.post(f"/runs/{run_id}/fork", json={"step": 1}).json()
    assert first["status"] == again["status"] == "ready"
    assert (again["run_id"], again["request_id"]) == (
        first["run_id"],
        first["request_id"],
    )  # the same fork, not a second one
    other = api.post(f"/runs/{run_id}/fork", json={"step": 2})
    assert other.status_code == 409 and "X-Idempotency-Key was used for a fork at step 1" in other.json()["detail"]
    api.close()


def test_a_seedless_run_forks_from_its_creation_and_a_cancelled_run_still_forks(server, alice, capsys):
    """No seed: the adapter was drawn from the run's own id, and the fork must draw the same."""
    training = alice.create_lora_training_client(base_model=MODEL, rank=4).result()
    at0 = training.save_state("at-0").result().path
    train(training, [5])
    at1 = training.save_state("at-1").result().path
    cancelled = httpx.post(f"{server.url}/api/openrl/v1/runs/{training.model_id}/cancel", headers={"X-API-Key": ALICE})
    assert cancelled.status_code == 200
    for step, saved in ((0, at0), (1, at1)):
        code, forked = fork(server, capsys, training.model_id, step)
        assert code == 0 and forked["status"] == "ready", forked
        assert forked["rebuilt_from"] == {"snapshot_step": None, "replayed_requests": 2 * step}  # from creation
        assert state_files(server, forked["tinker_path"]) == state_files(server, saved)


def test_full_finetuning_forks_the_same_way(server, alice, capsys):
    training = alice.create_lora_training_client(
        base_model=MODEL, user_metadata={"openrl.full_finetune": "true"}
    ).result()
    train(training, range(3))  # a snapshot after step 2
    at3 = training.save_state("at-3").result().path
    code, forked = fork(server, capsys, training.model_id, 3)
    assert code == 0 and forked["rebuilt_from"] == {"snapshot_step": 2, "replayed_requests": 2}, forked
    assert state_files(server, forked["tinker_path"]) == state_files(server, at3)
    assert "model.safetensors" in state_files(server, at3)  # every weight, not an adapter
    shown = httpx.get(f"{server.url}/api/openrl/v1/runs/{forked['run_id']}", headers={"X-API-Key": ALICE}).json()["run"]
    assert shown["training"] == "full" and shown["forked_from"] == {"run": training.model_id, "step": 3}


def test_bad_steps_other_tenants_and_unforkable_runs(server, alice, parent, capsys):
    run_id = parent["client"].model_id
    api = httpx.Client(base_url=f"{server.url}/api/openrl/v1", headers={"X-API-Key": ALICE})
    before = api.get("/runs").json()["total"]
    for body, fragment in (
        ({"step": -1}, "step must be 0 or more"),
        ({"step": 7}, "step must be between 0 and 6"),
        ({"step": "3"}, "step must be an integer"),
        ({}, '{"step": N}'),
        ({"step": 1, "at": 2}, "unknown field"),
        ({"step": 1, "wait_seconds": 1000}, "wait_seconds"),
    ):
        refused = api.post(f"/runs/{run_id}/fork", json=body)
        assert refused.status_code == 400 and fragment in refused.json()["detail"], (body, refused.text)
    code, past = fork(server, capsys, run_id, 99)
    assert code == 1 and past["status"] == 400 and "between 0 and 6" in past["detail"]
    assert api.get("/runs").json()["total"] == before  # nothing was made

    # Bob: alice's run is as unknown as a run that never existed.
    ghost = run_id.rsplit(":", 1)[0] + ":999"
    theirs, nobody = fork(server, capsys, run_id, 1, key=BOB), fork(server, capsys, ghost, 1, key=BOB)
    assert theirs[0] == nobody[0] == 1 and theirs[1]["status"] == nobody[1]["status"] == 404
    assert theirs[1]["detail"].replace(run_id, "ID") == nobody[1]["detail"].replace(ghost, "ID")

    copy = tinker.RestClient(base_url=server.url, api_key=ALICE).copy_weights(parent["at3"], "copies").result()
    frozen = api.post(f"/runs/{copy.split('/')[2]}/fork", json={"step": 0})
    assert frozen.status_code == 409 and "copy_weights" in frozen.json()["detail"]
    api.close()


def test_forks_are_events_that_replay_rebuilds(server, alice, parent, capsys):
    engine = create_engine(f"sqlite:///{server.data_dir / 'events.db'}")
    with engine.connect() as conn:
        keys = [
            row.key for row in conn.execute(text("SELECT key FROM events WHERE type = :t"), {"t": FORK["requested"]})
        ]
    engine.dispose()
    assert len(keys) >= 8 and len(set(keys)) == len(keys)  # one event per fork, the retried one included once
    close_service(alice)  # no more heartbeats: the store stands still
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    replayed = subprocess.run(
        [sys.executable, "-m", "functions.cli", "replay", "--data-dir", str(server.data_dir)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert replayed.returncode == 0 and "projections match" in replayed.stdout, replayed.stdout + replayed.stderr
