"""examples/lora_without_regret.py in a short form on the tiny model: six RL runs at once through
the real tinker SDK against one real `openrl serve` whose timeslicer budget holds one full
fine-tuning run beside the shared base weights and the adapters, not two.

The tiny model's random weights never answer a word problem, so the reward here alternates
(1, 0, ...) through the recipe's own `score` being swapped: every group then differs, and every
step of every run trains (forward_backward, optim_step, a new sampler). The numbers are the
plumbing's, not learning's; the real run on SmolLM2-135M is `make recipe-lora-without-regret`.
"""

from __future__ import annotations

import json
import math
import random

import httpx
import pytest

from functions.local_server import LocalServer
from tests.examples.conftest import EXAMPLES, TINY
from tests.examples.test_recipes import progress

pytestmark = pytest.mark.e2e
KEY = "tml-lwr"
# Tiny model, measured: base weights 76 MiB on the trainer and 76 MiB on the sampler (never
# parked), a full run 304 MiB + its 76 MiB sampler copy, LoRA rank 32 77 MiB, rank 1 2.4 MiB.
# 800 MiB holds everything with one full run, not with both: the full runs must park.
BUDGET = "800MiB"


@pytest.fixture(scope="module")
def budget_server(tmp_path_factory):
    env = {"OPENRL_ACCELERATOR_MEMORY": BUDGET}
    with LocalServer(tmp_path_factory.mktemp("openrl-lwr"), [TINY], f"lwr={KEY}", extra_env=env) as srv:
        yield srv


def test_six_runs_at_once_train_take_turns_and_report(budget_server, tmp_path):
    import os
    import subprocess
    import sys

    wrapper = tmp_path / "alternating_reward.py"
    wrapper.write_text(
        "import itertools, sys, threading\n"
        f"sys.path.insert(0, {str(EXAMPLES)!r})\n"
        "import lora_without_regret as recipe\n"
        "local = threading.local()  # each run (a thread) alternates on its own: every group of 2 differs\n"
        "def score(text, answer):\n"
        "    local.flip = getattr(local, 'flip', None) or itertools.cycle([1.0, 0.0])\n"
        "    return next(local.flip)\n"
        "recipe.score = score\n"
        "recipe.main()\n"
    )
    out = tmp_path / "lwr"
    env = dict(os.environ, TINKER_BASE_URL=budget_server.url, TINKER_API_KEY=KEY, TINKER_TELEMETRY="1",
               PYTHONFAULTHANDLER="1")  # fmt: skip
    args = ["--base-model", TINY, "--steps", "2", "--problems", "1", "--group-size", "2", "--max-tokens", "3",
            "--eval-problems", "1", "--solo-steps", "1", "--tail", "2", "--out", str(out)]  # fmt: skip
    done = subprocess.run([sys.executable, str(wrapper), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    names = [f"{arm}-s{seed}" for arm in ("full", "lora-r32", "lora-r1") for seed in (0, 1)]
    # A progress line per step of each of the six runs (and of the three runs measured alone).
    assert sorted(progress(done.stdout)) == sorted([(1, 2), (2, 2)] * 6 + [(1, 1)] * 3)
    for name in names:
        rows = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        # Every group differs, so every step trained: a finite loss, a gradient, a sampling rate.
        assert all(r["trained_rollouts"] == 2 and math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
        assert all(r["sampling_tokens_per_s"] > 0 and r["reward"] == 0.5 for r in rows)
    report = json.loads((out / "report.json").read_text())
    runs = {r["name"]: r for r in report["runs"]}
    assert sorted(runs) == sorted(names) and len({r["run_id"] for r in runs.values()}) == 6
    # The paper's rule: LoRA's learning rate is 10x full fine-tuning's, the same for both ranks.
    assert runs["lora-r32-s0"]["lr"] == runs["lora-r1-s1"]["lr"] == pytest.approx(10 * runs["full-s0"]["lr"])
    table = {row["arm"]: row for row in report["table"]}
    assert set(table) == {"full", "lora-r32", "lora-r1"}
    for row in table.values():
        assert row["tail_reward"] == pytest.approx(0.5) and row["spread"] == pytest.approx(0.0)
        assert 0.0 <= row["before"] <= 1.0 and 0.0 <= row["after"] <= 1.0
    # Duty cycle from the server's timeslicer timeline, in (0, 1]; the budget made the full runs park.
    device = report["concurrent"]["duty"]["devices"]["cpu:0"]
    assert 0.0 < device["duty_cycle"] <= 1.0 and device["parks"] >= 1
    assert report["sequential"]["wall_s"] > 0 and set(report["sequential"]["solo"]) == {"full", "lora-r32", "lora-r1"}
    # The recipe reported each step's reward through the SDK's telemetry: the server has it.
    listed = httpx.get(f"{budget_server.url}/api/openrl/v1/runs/{runs['full-s0']['run_id']}/metrics",
                       headers={"X-API-Key": KEY})  # fmt: skip
    rows = [json.loads(line) for line in listed.text.splitlines()]
    assert [(r["step"], r["reported"]["reward"]) for r in rows] == [(1, 0.5), (2, 0.5)]
    assert all(r["learning_rate"] == pytest.approx(runs["full-s0"]["lr"]) for r in rows)
    markdown = (out / "report.md").read_text()
    assert "| full | 5e-05 | 0.500 | 0.000 |" in markdown and "duty cycle at once" in markdown
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_word_problems_are_held_out_and_graded_by_their_last_number():
    import word_problems as wp

    held_out, stream = wp.split(7, 30)
    texts = {q for q, _, _ in held_out}
    assert len(texts) == 30
    train = stream(random.Random(0))
    drawn = [next(train) for _ in range(500)]
    assert not texts & {q for q, _, _ in drawn}
    # Every worked line's arithmetic is the answer, computed here independently of the template.
    for question, worked, answer in held_out + drawn:
        expression, result = worked.split(" = ")
        assert eval(expression.replace("/", "//")) == int(result) == answer and answer >= 0
        assert wp.score(f"so {worked}", answer) == 1.0 and wp.score(worked + " or 1000", answer) == 0.0
    assert wp.score("3 * 4 = 12", 12) == 1.0 and wp.score("no number", 12) == 0.0 and wp.score("1,200", 1200) == 1.0
