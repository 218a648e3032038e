"""`openrl runs export RUN --tensorboard DIR --jsonl FILE` against a live `openrl serve`, checked
against what the real tinker SDK did and read back with TensorBoard's own reader
(event_accumulator): every step is there, with the loss forward_backward returned, the grad
norm optim_step returned, the learning rate sent, the tokens trained on, the tokens sampled,
and the reward the client reported through the SDK's telemetry. Telemetry reports that are
malformed, or name another tenant's run, are dropped without costing the batch.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
import tinker
from tensorboard.backend.event_processing import event_accumulator
from tinker import types

from functions import cli
from functions.local_server import LocalServer
from functions.runs_export import run_dir
from tests.e2e.sdk_close import close_service

pytestmark = pytest.mark.e2e

MODEL = "openrl/tiny-qwen3"
ALICE, BOB = "tml-export-alice", "tml-export-bob"
LEARNING_RATES = (1e-3, 2e-3, 3e-3)
REWARDS = (0.25, 0.5, 0.875)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LocalServer(tmp_path_factory.mktemp("openrl-export"), [MODEL], f"alice={ALICE},bob={BOB}") as srv:
        yield srv


@pytest.fixture(scope="module")
def trained(server):
    """Alice runs three RL-shaped steps (sample, forward_backward, optim_step) and reports each
    step's reward through the SDK's telemetry, plus reports the server must drop."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TINKER_TELEMETRY", "1")
        service = tinker.ServiceClient(base_url=server.url, api_key=ALICE)
        training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
        telemetry = training.get_telemetry()
        assert telemetry is not None
        tokens = training.get_tokenizer().encode("Two plus three is five. " * 2)
        batch = [
            types.Datum(
                model_input=types.ModelInput.from_ints(piece[:-1]),
                loss_fn_inputs={"target_tokens": piece[1:], "weights": [1.0] * (len(piece) - 1)},
            )
            for piece in (tokens, tokens[:7])
        ]
        steps = []
        for step, (lr, reward) in enumerate(zip(LEARNING_RATES, REWARDS), start=1):
            sampler = training.save_weights_and_get_sampling_client().result()
            sampled = sampler.sample(
                types.ModelInput.from_ints(tokens[:5]),
                2,
                types.SamplingParams(max_tokens=3, temperature=1.0, seed=step),
            ).result()
            fb = training.forward_backward(batch, "cross_entropy").result()
            opt = training.optim_step(types.AdamParams(learning_rate=lr)).result()
            steps.append({"loss": fb.metrics["loss:sum"], "grad_norm": opt.metrics["optim/grad_norm"], "lr": lr,
                          "sampled": sum(len(s.tokens) for s in sampled.sequences), "reward": reward})  # fmt: skip
            assert telemetry.log("openrl.step_metrics", {"run_id": training.model_id, "step": step, "reward": reward})
        # Dropped, each for its own reason: a step that is not a step, no number, a non-finite number.
        telemetry.log("openrl.step_metrics", {"run_id": training.model_id, "step": "2", "reward": 1.0})
        telemetry.log("openrl.step_metrics", {"run_id": training.model_id, "step": 2, "note": "text"})
        telemetry.log("openrl.step_metrics", {"run_id": training.model_id, "step": 2, "reward": float("nan")})
        close_service(service)  # flushes the telemetry
    return {"run": training.model_id, "steps": steps, "tokens": sum(d.model_input.length for d in batch)}


def export(server, capsys, key, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main(["runs", "export", *args, "--url", server.url, "--api-key", key])
    return code, capsys.readouterr().out


def test_tensorboard_files_hold_every_step_as_the_sdk_saw_it(server, trained, tmp_path, capsys):
    run = trained["run"]
    code, out = export(server, capsys, ALICE, run, "--tensorboard", str(tmp_path / "tb"), "--json")
    assert code == 0, out
    answer = json.loads(out)
    assert answer["runs"] == [{"run_id": run, "steps": 3, "tensorboard": str(run_dir(tmp_path / "tb", run))}]

    accumulator = event_accumulator.EventAccumulator(str(run_dir(tmp_path / "tb", run)))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    wanted = {"loss", "optim/grad_norm", "learning_rate", "tokens", "forward_backward", "step_seconds",
              "queue_wait_seconds", "sampled_tokens", "sampling_seconds", "sampling_tokens_per_s", "reported/reward"}  # fmt: skip
    assert wanted <= tags, wanted - tags

    def series(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in accumulator.Scalars(tag)]

    steps = trained["steps"]
    assert [s for s, _ in series("loss")] == [1, 2, 3]  # every step, once
    # TensorBoard keeps float32: compare at its precision.
    for tag, key in (("loss", "loss"), ("optim/grad_norm", "grad_norm"), ("learning_rate", "lr"),
                     ("sampled_tokens", "sampled"), ("reported/reward", "reward")):  # fmt: skip
        assert series(tag) == [(i, pytest.approx(s[key], rel=1e-6)) for i, s in enumerate(steps, start=1)], tag
    assert series("tokens") == [(i, trained["tokens"]) for i in (1, 2, 3)]
    assert all(v > 0 and math.isfinite(v) for _, v in series("sampling_tokens_per_s"))
    assert all(v >= 0 for _, v in series("step_seconds"))
    # Wall times are the steps' completion times, in order.
    walls = [e.wall_time for e in accumulator.Scalars("loss")]
    assert walls == sorted(walls) and walls[0] > 1.7e9


def test_jsonl_holds_the_servers_rows_with_the_reported_numbers(server, trained, tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    code, out = export(server, capsys, ALICE, trained["run"], "--jsonl", str(path))
    assert code == 0 and f"{trained['run']}: 3 steps" in out
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and {r["run_id"] for r in rows} == {trained["run"]}
    # Only the well-formed reports: the malformed ones for step 2 changed nothing.
    assert [r["reported"] for r in rows] == [{"reward": reward} for reward in REWARDS]
    assert [r["loss"] for r in rows] == [s["loss"] for s in trained["steps"]]  # exact: JSON keeps float64
    assert [r["sampled_tokens"] for r in rows] == [s["sampled"] for s in trained["steps"]]


def test_reports_on_another_tenants_run_are_dropped_and_exports_refused(server, trained, tmp_path, capsys):
    run = trained["run"]
    forged = {"session_id": "bob-session", "events": [{
        "event": "GENERIC_EVENT", "event_id": "x", "event_name": "openrl.step_metrics", "event_session_index": 0,
        "severity": "INFO", "timestamp": "2026-01-01T00:00:00Z", "event_data": {"run_id": run, "step": 1, "reward": 99.0},
    }]}  # fmt: skip
    answer = httpx.post(server.url + "/api/v1/telemetry", json=forged, headers={"X-API-Key": BOB})
    assert answer.status_code == 200 and answer.json() == {"status": "accepted"}  # telemetry is never refused
    path = tmp_path / "alice.jsonl"
    assert export(server, capsys, ALICE, run, "--jsonl", str(path))[0] == 0
    assert json.loads(path.read_text().splitlines()[0])["reported"] == {"reward": REWARDS[0]}
    # Bob cannot export Alice's run: it does not exist for him, and nothing is written.
    code, out = export(server, capsys, BOB, run, "--jsonl", str(tmp_path / "bob.jsonl"), "--json")
    assert code == 1 and json.loads(out)["status"] == 404 and not (tmp_path / "bob.jsonl").exists()
    code, out = export(server, capsys, ALICE, run, "--json")
    assert code == 1 and "nothing to write" in json.loads(out)["detail"]
