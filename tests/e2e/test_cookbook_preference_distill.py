"""tinker-cookbook 0.6.1's DPO (`recipes.preference.dpo.train`) and on-policy distillation
(`recipes.distillation.on_policy_distillation`, teacher = a base model) against `openrl serve`
on the tiny model (served under the cookbook's Qwen names, cookbook_rig.py), offline: each
recipe's own CLI config and defaults, sizes cut on the command line (2-3 steps), and its one
hub dataset read from a local file (cookbook_local_data.py says exactly how)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tinker

from tests.e2e.conftest import API_KEY
from tests.e2e.cookbook_rig import finite, read_jsonl, recipe_env, run_recipe

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TOPICS = ["the sea", "a cat", "rain", "the moon", "bread", "a train", "winter", "a garden", "music", "a river",
          "the sun", "a book"]  # fmt: skip


def env_for(server, hf_home) -> dict[str, str]:
    env = recipe_env(server.url, API_KEY, hf_home)
    env["PYTHONPATH"] = f"{REPO}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO)
    return env


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_dpo_with_its_defaults_on_local_comparisons(sdk_env, hf_home, tmp_path):
    rows = [
        {"chosen": f"\n\nHuman: Write one line about {t}.\n\nAssistant: A calm, clear line about {t}.",
         "rejected": f"\n\nHuman: Write one line about {t}.\n\nAssistant: no"}
        for t in TOPICS
    ]  # fmt: skip
    data = write_jsonl(tmp_path / "hh.jsonl", rows)
    log_path = tmp_path / "dpo"
    args = ["model_name=Qwen/Qwen3-8B-Base", f"log_path={log_path}", "batch_size=4", "max_length=256", "max_steps=3"]
    done = run_recipe("tests.e2e.cookbook_local_data", ["dpo", str(data), *args], env_for(sdk_env, hf_home), tmp_path)
    assert done.returncode == 0, done.stdout[-6000:]
    metrics = {row["step"]: row for row in read_jsonl(log_path / "metrics.jsonl") if "step" in row}
    assert sorted(metrics)[:3] == [0, 1, 2], sorted(metrics)
    for step in (0, 1, 2):
        row = metrics[step]
        # the DPO loss and its margins, from forward_backward_custom over the reference logprobs
        assert finite(row["dpo_loss"]) and finite(row["accuracy"]) and finite(row["margin"]), row
    assert metrics[0]["dpo_loss"] == pytest.approx(0.6931, abs=2e-3)  # the policy starts as its reference: log 2
    saved = read_jsonl(log_path / "checkpoints.jsonl")
    assert saved and saved[-1]["name"] == "final"


def test_on_policy_distillation_from_a_base_model_teacher(sdk_env, hf_home, tmp_path):
    data = write_jsonl(tmp_path / "deepmath.jsonl", [{"question": f"What is {i} + {i + 3}?"} for i in range(8)])
    log_path = tmp_path / "distill"
    args = ["model_name=Qwen/Qwen3-8B-Base", "teacher_model=Qwen/Qwen3-8B", f"log_path={log_path}",
            "groups_per_batch=2", "max_tokens=8", "lora_rank=8", "max_steps=2", "eval_every=0", "save_every=0"]  # fmt: skip
    done = run_recipe(
        "tests.e2e.cookbook_local_data", ["distillation", str(data), *args], env_for(sdk_env, hf_home), tmp_path
    )
    assert done.returncode == 0, done.stdout[-6000:]
    rows = {row["step"]: row for row in read_jsonl(log_path / "metrics.jsonl") if "step" in row}
    for step in (0, 1):
        row = rows[step]
        assert row["env/all/total_episodes"] == 8, row  # 2 prompts x group_size 4, sampled by the server
        kl = [key for key in row if "teacher_kl" in key or key.endswith("kl_policy_base")]
        assert kl and all(finite(row[key]) for key in kl), row  # the teacher's logprobs came back
        assert finite(row["optim/grad_norm"]), row
    saved = read_jsonl(log_path / "checkpoints.jsonl")
    assert saved[-1]["name"] == "final"
    run_id = saved[-1]["state_path"].removeprefix("tinker://").split("/")[0]
    run = tinker.RestClient().get_training_run(run_id).result()
    assert run.base_model == "Qwen/Qwen3-8B-Base"
