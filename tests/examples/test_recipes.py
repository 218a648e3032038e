"""The recipes in examples/, in short forms on the tiny model: each loop runs end to end through
the real tinker SDK against a real `openrl serve` and writes its curve (JSONL + PNG).

The tiny model has random weights, so these check the plumbing, not learning; the full runs
on SmolLM2-135M are measured with `make demo|recipe-sql|recipe-rlvr|autoresearch` (README).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.examples.conftest import API_KEY, EXAMPLES, TINY

pytestmark = pytest.mark.e2e

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def progress(stdout: str, what: str = "step") -> list[tuple[int, int]]:
    """(done, total) of each progress line that carries an elapsed time and an ETA."""
    return [
        (int(m[1]), int(m[2]))
        for m in re.finditer(rf"^(?:\[[^\]]*\] )?{what} (\d+)/(\d+) .*elapsed \d+s  eta \d+s$", stdout, re.M)
    ]


def curve(stem: Path) -> list[dict]:
    # Run names such as "lr0.001_r4_g2" hold dots, so no Path.with_suffix here.
    rows = [json.loads(line) for line in Path(f"{stem}.jsonl").read_text().splitlines()]
    assert Path(f"{stem}.png").read_bytes()[:8] == PNG_MAGIC
    return rows


def test_text_to_sql_rl_short_run(run_example, tmp_path):
    out = tmp_path / "sql"
    done = run_example(
        "text_to_sql_rl.py",
        "--base-model",
        TINY,
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--group-size",
        "2",
        "--max-tokens",
        "4",
        "--eval-size",
        "3",
        "--out",
        str(out),
    )
    rows = curve(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 <= r["reward"] <= 1.1 and "eta" not in r for r in rows)
    assert progress(done.stdout) == [(1, 2), (2, 2)]  # a progress line per step, with its ETA
    summary = json.loads((tmp_path / "sql.summary.json").read_text())
    assert summary["test_questions"] == 3 and 0.0 <= summary["after"] <= 1.0


def test_text_to_sql_rl_short_run_trains_and_exits_cleanly(run_example, tmp_path):
    """The recipe's training branch as a script: on the tiny model's random weights every reward
    is equal and no group trains, so here the reward alternates (1.1, 0.0, ...) and every group
    differs. Each step then runs forward_backward (importance_sampling) in pieces, optim_step
    and a new sampling client, and the process still exits 0 (a run like this once aborted
    with SIGABRT at interpreter exit after writing its numbers)."""
    wrapper = tmp_path / "alternating_reward.py"
    wrapper.write_text(
        "import itertools, sys\n"
        f"sys.path.insert(0, {str(EXAMPLES)!r})\n"
        "import text_to_sql_rl as recipe\n"
        "flip = itertools.cycle([(1.1, True), (0.0, False)])\n"
        "recipe.reward = lambda conn, item, text: next(flip)\n"
        "recipe.main()\n"
    )
    out = tmp_path / "trained"
    done = run_example(
        str(wrapper),
        "--base-model",
        TINY,
        "--steps",
        "3",
        "--batch-size",
        "2",
        "--group-size",
        "2",
        "--max-tokens",
        "3",
        "--eval-size",
        "2",
        "--train-chunk",
        "3",
        "--out",
        str(out),
    )
    rows = curve(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["trained_groups"] == 2 and math.isfinite(r["loss"]) for r in rows)  # every group trained
    assert progress(done.stdout) == [(1, 3), (2, 3), (3, 3)]
    assert json.loads(Path(f"{out}.summary.json").read_text())["steps"] == 3


def test_rlvr_arithmetic_short_run(run_example, tmp_path):
    out = tmp_path / "rlvr"
    done = run_example(
        "rlvr_arithmetic.py",
        "--base-model",
        TINY,
        "--steps",
        "2",
        "--problems",
        "2",
        "--rollouts",
        "2",
        "--max-tokens",
        "3",
        "--eval-problems",
        "2",
        "--out",
        str(out),
    )
    assert progress(done.stdout) == [(1, 2), (2, 2)]
    rows = curve(out)
    assert [r["step"] for r in rows] == [1, 2] and all(0.0 <= r["reward"] <= 1.0 for r in rows)


def test_pig_latin_short_run_trains(run_example, tmp_path):
    out = tmp_path / "pig"
    done = run_example(
        "pig_latin_sft.py",
        "--base-model",
        TINY,
        "--train-words",
        "8",
        "--test-words",
        "2",
        "--batch-size",
        "4",
        "--out",
        str(out),
    )
    assert progress(done.stdout) == [(1, 2), (2, 2)]
    rows = curve(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)
    assert rows[0]["learning_rate"] > rows[1]["learning_rate"] > 0  # the linear decay


def test_autoresearch_sweep_varies_rank_runs_in_turns_and_writes_a_report(run_example, tmp_path):
    out = tmp_path / "sweep"
    done = run_example(
        "autoresearch_sql.py",
        "--base-model",
        TINY,
        "--learning-rates",
        "1e-4,1e-3",
        "--ranks",
        "2,4",
        "--group-sizes",
        "2",
        "--parallel",
        "2",
        "--steps",
        "1",
        "--batch-size",
        "1",
        "--eval-size",
        "1",
        "--max-tokens",
        "2",
        "--out",
        str(out),
    )
    names = [f"lr{lr}_r{rank}_g2" for lr in ("0.0001", "0.001") for rank in (2, 4)]
    assert sorted(n for n, _ in progress(done.stdout, "run")) == [1, 2, 3, 4]  # a line per finished run, with its ETA
    assert {total for _, total in progress(done.stdout, "run")} == {4}
    report = (out / "report.md").read_text()
    table = [line.split(" | ") for line in report.splitlines() if line.startswith("| lr")]
    assert sorted((row[0].removeprefix("| ").removesuffix(" **best**"), row[2]) for row in table) == sorted(
        (name, name.split("_r")[1].split("_")[0]) for name in names
    )  # the rank column
    assert "| LoRA rank |" in report and report.count("**best**") == 1
    assert (out / "report.png").read_bytes()[:8] == PNG_MAGIC
    summary = json.loads((out / "report.json").read_text())
    assert sorted(r["name"] for r in summary["runs"]) == sorted(names) and all(r["ok"] for r in summary["runs"])
    assert {(r["lr"], r["rank"]) for r in summary["runs"]} == {(lr, rank) for lr in (1e-4, 1e-3) for rank in (2, 4)}
    # --parallel 2: at no moment were more than two runs in flight (and two did overlap).
    moments = sorted({r["started_s"] for r in summary["runs"]})
    in_flight = [sum(r["started_s"] <= t < r["ended_s"] for r in summary["runs"]) for t in moments]
    assert max(in_flight) == 2
    for name in names:
        assert len(curve(out / name)) == 1


def test_autoresearch_labels_each_curve_with_its_grid_point():
    import autoresearch_sql

    assert (
        autoresearch_sql.legend_label({"lr": 1e-3, "rank": 32, "group": 8, "after": 0.95})
        == "lr 0.001, rank 32, group 8 (95%)"
    )


def test_grpo_datums_train_with_importance_sampling(recipe_server):
    """The recipe's own datums (sampled tokens, sampler logprobs, group advantages) go through
    forward_backward with importance_sampling: with random weights no reward varies, so the
    short runs above may never send one."""
    import text_to_sql_rl as recipe

    service = tinker.ServiceClient(base_url=recipe_server.url, api_key=API_KEY)
    training = service.create_lora_training_client(base_model=TINY, rank=4).result()
    prompt = [1, 2, 3, 4]
    sampled = (
        training.save_weights_and_get_sampling_client()
        .result()
        .sample(types.ModelInput.from_ints(prompt), 3, types.SamplingParams(max_tokens=3, temperature=1.0))
        .result()
    )
    datums = recipe.group_datums(prompt, sampled.sequences, [1.1, 0.1, 0.0])
    advantages = [d.loss_fn_inputs["advantages"].to_numpy() for d in datums]
    assert all(list(a[: len(prompt) - 1]) == [0.0] * (len(prompt) - 1) for a in advantages)
    assert abs(sum(a[-1] for a in advantages)) < 1e-6  # minus the group mean: they cancel
    output = training.forward_backward(datums, "importance_sampling").result()
    step = training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    # The loss is -sum(exp(trainer - sampler logprobs) * advantage), recomputed here from what
    # came back. (It may be exactly 0: with a fresh adapter the ratios can be exactly 1 and
    # the advantages cancel; the gradient, -sum(advantage * dlogprob), still is not.)
    expected = 0.0
    for datum, out in zip(datums, output.loss_fn_outputs):
        ratio = np.exp(out["logprobs"].to_numpy() - datum.loss_fn_inputs["logprobs"].to_numpy())
        expected -= float(np.sum(ratio * datum.loss_fn_inputs["advantages"].to_numpy()))
    assert math.isfinite(output.metrics["loss:sum"])
    assert output.metrics["loss:sum"] == pytest.approx(expected, abs=1e-4)
    assert step.metrics["optim/grad_norm"] > 0.0
