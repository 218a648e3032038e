"""`openrl runs|checkpoints|sessions` against a live `openrl serve`, checked against what the
real tinker SDK did: step counts, per-step metrics (loss exactly as forward_backward returned
it), tenant isolation, the operator's view, checkpoint archives, and cancelling a run
(its queued future fails as cancelled, the SDK's next call gets a 410, the event is stored,
the trainer drops the run, its saved checkpoint stays and downloads the same bytes, and
replaying the events rebuilds the same projections)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import time

import httpx
import pytest
import tinker
from sqlalchemy import create_engine, text
from tinker import types

from functions import cli
from functions.local_server import REPO, LocalServer
from openrl_core.events.training import RUN_CANCELLED
from tests.e2e.sdk_close import close_service

pytestmark = pytest.mark.e2e

MODEL = "openrl/tiny-qwen3"
ALICE, BOB, OPERATOR = "tml-runs-alice", "tml-runs-bob", "tml-runs-operator"
LEARNING_RATES = (1e-3, 2e-3, 3e-3)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LocalServer(
        tmp_path_factory.mktemp("openrl-cli"), [MODEL], f"alice={ALICE},bob={BOB}",
        extra_env={"OPENRL_OPERATOR_API_KEY": OPERATOR, "TINKER_TELEMETRY": "0"},
    ) as srv:  # fmt: skip
        yield srv


def batch_of(tokenizer) -> list[types.Datum]:
    tokens = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2)
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(piece[:-1]),
            loss_fn_inputs={"target_tokens": piece[1:], "weights": [1.0] * (len(piece) - 1)},
        )
        for piece in (tokens, tokens[:9])
    ]


@pytest.fixture(scope="module")
def runs(server, monkeypatch_module):
    """Alice trains three steps (and saves two sampler checkpoints); Bob trains one."""
    monkeypatch_module.setenv("TINKER_TELEMETRY", "0")
    alice = tinker.ServiceClient(base_url=server.url, api_key=ALICE)
    training = alice.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    batch = batch_of(training.get_tokenizer())
    steps = []
    for lr in LEARNING_RATES:
        fb = training.forward_backward(batch, "cross_entropy").result()
        opt = training.optim_step(types.AdamParams(learning_rate=lr)).result()
        steps.append((fb.metrics["loss:sum"], opt.metrics["optim/grad_norm"], lr))
    kept = training.save_weights_for_sampler("kept").result().path
    dropped = training.save_weights_for_sampler("dropped").result().path
    bob = tinker.ServiceClient(base_url=server.url, api_key=BOB)
    bob_training = bob.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    bob_training.forward_backward(batch, "cross_entropy").result()
    bob_training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return {
        "alice": alice, "bob": bob, "run": training.model_id, "bob_run": bob_training.model_id, "steps": steps,
        "tokens": sum(d.model_input.length for d in batch), "kept": kept, "dropped": dropped, "batch": batch,
    }  # fmt: skip


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def openrl(server, capsys, key, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main([*args, "--url", server.url, "--api-key", key])
    return code, capsys.readouterr().out


def as_json(server, capsys, key, *args):
    code, out = openrl(server, capsys, key, *args, "--json")
    return code, json.loads(out)


def test_runs_list_and_metrics_are_what_the_sdk_did(server, runs, capsys):
    code, listing = as_json(server, capsys, ALICE, "runs", "list")
    assert code == 0 and listing["schema"] == "openrl.runs.v1"
    assert [r["run_id"] for r in listing["runs"]] == [runs["run"]]  # Bob's run is not Alice's to see
    [run] = listing["runs"]
    assert run["status"] == "active" and run["training"] == "lora" and run["base_model"] == MODEL
    assert run["steps"] == 3 and run["lora_rank"] == 4 and run["tenant"] == "alice"

    code, out = openrl(server, capsys, ALICE, "runs", "show", runs["run"], "--metrics", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [row["step"] for row in rows] == [1, 2, 3]
    for row, (loss, grad_norm, lr) in zip(rows, runs["steps"]):
        assert row["schema"] == "openrl.metrics.v1"
        assert row["loss"] == loss and row["optim/grad_norm"] == grad_norm and row["learning_rate"] == lr
        assert row["tokens"] == runs["tokens"] and row["forward_backward"] == 1
        assert isinstance(row["step_seconds"], float) and row["step_seconds"] >= row["queue_wait_seconds"] >= 0

    code, table = openrl(server, capsys, ALICE, "runs", "list")
    header, line = table.splitlines()
    assert header.split()[:3] == ["RUN", "STATUS", "BASE"] and line.split()[:3] == [runs["run"], "active", MODEL]
    code, table = openrl(server, capsys, ALICE, "runs", "show", runs["run"], "--metrics")
    assert table.splitlines()[0].startswith("STEP") and len(table.splitlines()) == 4
    code, shown = as_json(server, capsys, ALICE, "runs", "show", runs["run"])
    assert shown["schema"] == "openrl.run.v1" and shown["last_step"]["step"] == 3
    assert {c["tinker_path"] for c in shown["checkpoints"]} == {runs["kept"], runs["dropped"]}


def test_another_tenants_run_answers_like_an_unknown_one_and_the_operator_sees_all(server, runs, capsys):
    unknown = runs["bob_run"].rsplit(":", 1)[0] + ":999"
    for verb in (("runs", "show"), ("runs", "show", "--metrics"), ("runs", "cancel")):
        theirs = as_json(server, capsys, ALICE, *verb[:2], runs["bob_run"], *verb[2:])
        nobody = as_json(server, capsys, ALICE, *verb[:2], unknown, *verb[2:])
        assert theirs[0] == nobody[0] == 1
        assert theirs[1]["status"] == nobody[1]["status"] == 404
        assert theirs[1]["detail"].replace(runs["bob_run"], "ID") == nobody[1]["detail"].replace(unknown, "ID")
    bob_path = f"tinker://{runs['bob_run']}/sampler_weights/kept"
    _, theirs = as_json(server, capsys, ALICE, "checkpoints", "download", bob_path)
    assert theirs["status"] == 404

    _, everyone = as_json(server, capsys, OPERATOR, "runs", "list")
    assert {(r["run_id"], r["tenant"]) for r in everyone["runs"]} == {(runs["run"], "alice"), (runs["bob_run"], "bob")}
    # Bad input: a clear 4xx that says what is wrong.
    api = httpx.Client(base_url=server.url + "/api/openrl/v1", headers={"X-API-Key": ALICE})
    for path, params in (
        ("/checkpoints/archive", {"path": "tinker://../x"}),
        ("/runs", {"limit": 0}),
        ("/runs", {"status": "odd"}),
    ):
        bad = api.get(path, params=params)
        assert bad.status_code == 400 and bad.json()["detail"], (path, bad.text)
    assert api.get("/runs", headers={"X-API-Key": "tml-nobody"}).status_code == 401
    api.close()
    # The operator's key is nobody's Tinker key.
    refused = httpx.post(
        server.url + "/api/v1/create_session", json={"tags": [], "sdk_version": "x"}, headers={"X-API-Key": OPERATOR}
    )
    assert refused.status_code == 401


def test_checkpoints_download_writes_the_archive_and_delete_removes(server, runs, capsys, tmp_path):
    _, listing = as_json(server, capsys, ALICE, "checkpoints", "list", "--run", runs["run"])
    assert listing["schema"] == "openrl.checkpoints.v1" and len(listing["checkpoints"]) == 2
    code, table = openrl(server, capsys, ALICE, "checkpoints", "list", "--run", runs["run"])  # the table, by default
    header, *rows = table.splitlines()
    assert code == 0 and header.split()[:3] == ["PATH", "KIND", "BYTES"]
    assert sorted(row.split()[0] for row in rows) == sorted([runs["kept"], runs["dropped"]])
    assert {int(row.split()[2]) for row in rows} == {c["size_bytes"] for c in listing["checkpoints"]}
    target = tmp_path / "kept.tar"
    code, written = as_json(server, capsys, ALICE, "checkpoints", "download", runs["kept"], "-o", str(target))
    assert code == 0 and written["size_bytes"] == target.stat().st_size
    code, said = openrl(
        server, capsys, ALICE, "checkpoints", "download", runs["kept"], "-o", str(tmp_path / "again.tar")
    )
    assert code == 0 and said.strip() == f"wrote {tmp_path / 'again.tar'} ({target.stat().st_size} bytes)"
    rest = httpx.get(
        server.url + "/api/openrl/v1/checkpoints/archive", params={"path": runs["kept"]}, headers={"X-API-Key": ALICE}
    )
    assert rest.status_code == 200 and target.read_bytes() == rest.content
    with tarfile.open(fileobj=io.BytesIO(rest.content)) as archive:
        assert sorted(archive.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert json.loads(archive.extractfile("adapter_config.json").read())["r"] == 4

    code, deleted = as_json(server, capsys, ALICE, "checkpoints", "delete", runs["dropped"])
    assert code == 0 and deleted["tinker_path"] == runs["dropped"]
    _, listing = as_json(server, capsys, ALICE, "checkpoints", "list")
    assert [c["tinker_path"] for c in listing["checkpoints"]] == [runs["kept"]]
    code, table = openrl(server, capsys, ALICE, "sessions", "list")
    assert table.splitlines()[0].split()[:2] == ["SESSION", "STATUS"]
    _, sessions = as_json(server, capsys, ALICE, "sessions", "list")
    assert sessions["schema"] == "openrl.sessions.v1" and [s["training_runs"] for s in sessions["sessions"]] == [1]


def test_cancel_fails_queued_work_refuses_later_calls_keeps_checkpoints_and_replays(server, runs, capsys, tmp_path):
    alice = runs["alice"]
    training = alice.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    training.forward_backward(runs["batch"], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    saved = training.save_state("before-cancel").result().path
    code, _ = as_json(server, capsys, ALICE, "checkpoints", "download", saved, "-o", str(tmp_path / "before.tar"))
    assert code == 0
    sampler = training.save_weights_and_get_sampling_client().result()
    # A request queued behind a seq gap that will never fill: its future stays pending.
    queued = httpx.post(
        server.url + "/api/v1/optim_step", headers={"X-API-Key": ALICE},
        json={"model_id": training.model_id, "seq_id": 1000, "adam_params": {"learning_rate": 1e-3}, "type": "optim_step"},
    ).json()["request_id"]  # fmt: skip

    env = {"TINKER_BASE_URL": server.url, "TINKER_API_KEY": ALICE, "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "functions.cli", "runs", "cancel", training.model_id, "--reason", "test", "--json"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )  # fmt: skip
    answer = json.loads(done.stdout)
    assert done.returncode == 0 and answer["schema"] == "openrl.cancel.v1", done.stderr
    assert answer["cancelled_requests"] == 1 and len(answer["closed_sampling_sessions"]) == 1

    failed = httpx.post(
        server.url + "/api/v1/retrieve_future", json={"request_id": queued}, headers={"X-API-Key": ALICE}
    ).json()
    assert failed["category"] == "user" and failed["error"].startswith("cancelled: ") and "test" in failed["error"]
    with pytest.raises(tinker.APIStatusError) as refused:
        training.forward_backward(runs["batch"], "cross_entropy").result()
    assert refused.value.status_code == 410 and "was cancelled" in str(refused.value)
    with pytest.raises(tinker.APIStatusError) as closed:
        sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)).result()
    assert closed.value.status_code == 410 and "closed" in str(closed.value)
    _, again = as_json(server, capsys, ALICE, "runs", "cancel", training.model_id)
    assert again["status"] == 409 and "already cancelled" in again["detail"]
    capsys.readouterr()
    assert (
        cli.main(["runs", "cancel", training.model_id, "--url", server.url, "--api-key", ALICE]) == 1
    )  # without --json: stderr
    said = capsys.readouterr()
    assert said.out == "" and said.err.startswith("openrl runs cancel: ") and "already cancelled" in said.err
    _, cancelled = as_json(server, capsys, ALICE, "runs", "list", "--status", "cancelled")
    assert [r["run_id"] for r in cancelled["runs"]] == [training.model_id]
    code, by_operator = openrl(server, capsys, OPERATOR, "runs", "cancel", runs["bob_run"])  # the sentence, by default
    assert code == 0 and by_operator.strip() == f"cancelled {runs['bob_run']}: 0 pending request(s) failed"
    _, bobs = as_json(server, capsys, BOB, "runs", "list")
    assert [(r["run_id"], r["status"]) for r in bobs["runs"]] == [(runs["bob_run"], "cancelled")]
    # Its saved checkpoint stays: listed, and the same archive as before the cancel.
    _, listing = as_json(server, capsys, ALICE, "checkpoints", "list", "--run", training.model_id)
    assert saved in [c["tinker_path"] for c in listing["checkpoints"]]
    code, _ = as_json(server, capsys, ALICE, "checkpoints", "download", saved, "-o", str(tmp_path / "after.tar"))
    assert code == 0 and (tmp_path / "after.tar").read_bytes() == (tmp_path / "before.tar").read_bytes()
    with tarfile.open(tmp_path / "after.tar") as archive:
        assert "adapter_model.safetensors" in archive.getnames()

    engine = create_engine(f"sqlite:///{server.data_dir / 'events.db'}")
    with engine.connect() as conn:
        keys = {row.key for row in conn.execute(text("SELECT key FROM events WHERE type = :t"), {"t": RUN_CANCELLED})}
    engine.dispose()
    assert keys == {training.model_id, runs["bob_run"]}
    deadline = time.monotonic() + 30
    while (
        f"{training.model_id} was cancelled; dropped its state" not in server.log_tail() and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert f"{training.model_id} was cancelled; dropped its state" in server.log_tail()

    for client in (runs["alice"], runs["bob"]):  # no more heartbeats: the store stands still
        close_service(client)
    time.sleep(1.0)
    replayed = subprocess.run(
        [sys.executable, "-m", "functions.cli", "replay", "--data-dir", str(server.data_dir)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert replayed.returncode == 0 and "projections match" in replayed.stdout, replayed.stdout + replayed.stderr
