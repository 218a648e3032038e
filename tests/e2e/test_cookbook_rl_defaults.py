"""tinker-cookbook 0.6.1's two RL recipes with their DEFAULT configuration against `openrl serve`.

Both default to `loss_fn=stable_reinforce`: they sample with `record_stability_info=true`
and send every datum with provenance spans naming the sampled sequences. Nothing about the
loss is overridden here; only what running offline on the tiny model for two steps needs:
the model name (an alias of the tiny model the cookbook knows, `cookbook_rig`), batch and
group sizes, `max_tokens`, `max_steps`, the log path, and for `rl_loop` a local stand-in for
`openai/gsm8k` in the datasets cache (`cookbook_datasets`).

On the tiny (random) model `rl_loop`'s GSM8K grader gives every sample reward 0, so the
recipe skips its training steps ("all advantages zero"): its test covers sampling with
`record_stability_info` and the recipe's run to its final checkpoint; `math_rl`, whose
arithmetic env scores format too, trains with `stable_reinforce` every step.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import API_KEY
from tests.e2e.cookbook_datasets import populate_gsm8k_cache
from tests.e2e.cookbook_rig import finite, read_jsonl, recipe_env, run_recipe

pytestmark = pytest.mark.e2e


def test_math_rl_arithmetic_with_its_default_stable_reinforce(sdk_env, hf_home, tmp_path):
    log_path = tmp_path / "math_rl"
    args = [
        "env=arithmetic",
        "model_name=Qwen/Qwen3-8B",
        f"log_path={log_path}",
        "group_size=4",
        "groups_per_batch=4",
        "max_tokens=5",
        "max_steps=2",
        "eval_every=0",
        "save_every=0",
        "lora_rank=8",
    ]
    done = run_recipe(
        "tinker_cookbook.recipes.math_rl.train", args, recipe_env(sdk_env.url, API_KEY, hf_home), tmp_path
    )
    assert done.returncode == 0, done.stdout[-6000:]
    assert "Training completed successfully" in done.stdout
    rows = {row["step"]: row for row in read_jsonl(log_path / "metrics.jsonl")}
    for step in (0, 1):
        row = rows[step]
        assert row["env/all/total_episodes"] == 16, row
        for key in ("optim/grad_norm", "optim/kl_sample_train_v1", "env/all/reward/total"):
            assert finite(row[key]), (key, row)
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-3  # the recorded sampler and the trainer agree


def test_rl_loop_with_its_default_stable_reinforce(sdk_env, hf_home, tmp_path):
    env = recipe_env(sdk_env.url, API_KEY, hf_home)
    env["HF_DATASETS_CACHE"] = str(populate_gsm8k_cache(tmp_path / "datasets"))
    log_path = tmp_path / "rl_loop"
    args = [
        "model_name=Qwen/Qwen3-8B-Base",
        f"log_path={log_path}",
        "batch_size=2",
        "group_size=4",
        "max_tokens=6",
        "max_steps=2",
        "lora_rank=8",
    ]
    done = run_recipe("tinker_cookbook.recipes.rl_loop", args, env, tmp_path)
    assert done.returncode == 0, done.stdout[-6000:]
    assert "Training completed" in done.stdout
    assert "record_stability_info" not in done.stdout  # no refusal anywhere in the run
    rows = {row["step"]: row for row in read_jsonl(log_path / "metrics.jsonl")}
    assert sorted(rows) == [0, 1], rows
    for row in rows.values():
        assert finite(row["reward/total"]), row
    saved = read_jsonl(log_path / "checkpoints.jsonl")
    assert saved[-1]["name"] == "final"
