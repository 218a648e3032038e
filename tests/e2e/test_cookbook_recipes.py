"""tinker-cookbook 0.6.1 recipes, unmodified, against `openrl serve` on the tiny model, offline.

Each recipe runs as a researcher runs it, `python -m tinker_cookbook.recipes.<name> key=value…`,
with only command-line overrides (chz):

* `sl_basic`: its default dataset (no_robots) lives on the Hub, so its `dataset_builder` is
  swapped on the command line for the `FromConversationFileBuilder` the recipe itself
  suggests, on the cookbook's bundled `example_data/conversations.jsonl`, with
  `model_name=Qwen/Qwen3-8B-Base` (renderer `role_colon`, served by the tiny model through an
  alias). Not `Qwen/Qwen3-8B`: the cookbook builds a `qwen3` renderer per example, which
  deep-copies the 18 MB tokenizer each time (about a second per example on this machine).
* `math_rl env=arithmetic` (synthetic addition problems): `model_name=Qwen/Qwen3-8B`
  (renderer `qwen3`, a chat template that stops on a token id) with
  `loss_fn=importance_sampling`; its default `stable_reinforce` runs in
  `test_cookbook_rl_defaults.py`.

Checks are on what the recipes write (metrics.jsonl, checkpoints.jsonl, their log) and on
what the server then lists through the REST API.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tinker
import tinker_cookbook

from tests.e2e.conftest import API_KEY
from tests.e2e.cookbook_rig import finite, read_jsonl, recipe_env, run_id_of, run_recipe

pytestmark = pytest.mark.e2e

CONVERSATIONS = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"


def checkpoint_ids(run_id: str) -> set[str]:
    return {c.checkpoint_id for c in tinker.RestClient().list_checkpoints(run_id).result().checkpoints}


def test_sl_basic_on_the_bundled_conversations(sdk_env, hf_home, tmp_path):
    log_path = tmp_path / "sl_basic"
    chat = "dataset_builder.common_config."
    args = [
        "model_name=Qwen/Qwen3-8B-Base",
        f"log_path={log_path}",
        "dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
        f"dataset_builder.file_path={CONVERSATIONS}",
        "dataset_builder.test_size=16",
        f"{chat}model_name_for_tokenizer=Qwen/Qwen3-8B-Base",
        f"{chat}renderer_name=role_colon",
        f"{chat}batch_size=16",
        f"{chat}max_length=512",
        "max_steps=3",
        "eval_every=2",
        "save_every=2",
        "lora_rank=8",
    ]
    done = run_recipe("tinker_cookbook.recipes.sl_basic", args, recipe_env(sdk_env.url, API_KEY, hf_home), tmp_path)
    assert done.returncode == 0, done.stdout[-6000:]
    assert "Training completed successfully" in done.stdout  # after the session's finish

    metrics = {row["step"]: row for row in read_jsonl(log_path / "metrics.jsonl")}
    assert sorted(metrics) == [0, 1, 2]
    for step, row in metrics.items():
        assert finite(row["train_mean_nll"]) and row["train_mean_nll"] > 0, row  # the loss, every step
        assert row["num_sequences"] == 16 and finite(row["optim/grad_norm"]), row
    for step in (0, 2):  # the held-out NLL, computed with compute_logprobs on a sampler snapshot
        assert finite(metrics[step]["test/nll"]) and metrics[step]["test/nll"] > 0

    saved = read_jsonl(log_path / "checkpoints.jsonl")
    assert [row["name"] for row in saved] == ["000002", "final"]
    run_id = run_id_of(saved[-1]["state_path"])
    assert checkpoint_ids(run_id) >= {
        "weights/000002",
        "sampler_weights/000002",
        "weights/final",
        "sampler_weights/final",
    }
    run = tinker.RestClient().get_training_run(run_id).result()
    assert run.base_model == "Qwen/Qwen3-8B-Base" and run.lora_rank == 8
    assert (run.user_metadata or {}).get("renderer_name") == "role_colon"


def math_rl_args(log_path: Path, *extra: str, model: str = "Qwen/Qwen3-8B") -> list[str]:
    return [
        "env=arithmetic",
        f"model_name={model}",
        f"log_path={log_path}",
        "group_size=4",
        "groups_per_batch=4",
        "max_tokens=5",
        "max_steps=2",
        "eval_every=0",
        "save_every=0",
        "lora_rank=8",
        *extra,
    ]


def test_math_rl_arithmetic_with_importance_sampling(sdk_env, hf_home, tmp_path):
    log_path = tmp_path / "math_rl"
    args = math_rl_args(log_path, "loss_fn=importance_sampling")
    done = run_recipe(
        "tinker_cookbook.recipes.math_rl.train", args, recipe_env(sdk_env.url, API_KEY, hf_home), tmp_path
    )
    assert done.returncode == 0, done.stdout[-6000:]
    assert "Training completed successfully" in done.stdout

    rows = {row["step"]: row for row in read_jsonl(log_path / "metrics.jsonl")}
    for step in (0, 1):
        row = rows[step]
        assert row["env/all/total_episodes"] == 16, row  # 4 groups x 4 samples, sampled by the server
        assert 0 < row["env/all/ac_tokens_per_turn"] <= 5  # max_tokens honoured
        # the trainer's logprobs came back for every sampled token: the sample/train KL is computed from them
        for key in ("optim/grad_norm", "optim/kl_sample_train_v1", "optim/entropy", "env/all/reward/total"):
            assert finite(row[key]), (key, row)
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-3  # same weights, sampler and trainer agree
    saved = read_jsonl(log_path / "checkpoints.jsonl")
    assert saved[-1]["name"] == "final"
    run_id = run_id_of(saved[-1]["state_path"])
    assert checkpoint_ids(run_id) >= {"weights/final", "sampler_weights/final"}
    run = tinker.RestClient().get_training_run(run_id).result()
    assert run.base_model == "Qwen/Qwen3-8B" and (run.user_metadata or {}).get("renderer_name") == "qwen3"


def test_math_rl_unchanged_trains_a_full_run_when_the_name_is_configured_full(sdk_env, hf_home, tmp_path):
    """`Qwen/Qwen3-32B` is listed in OPENRL_FULL_FINETUNE_MODELS: the recipe's LoRA client is a
    full fine-tuning run, its sampler serves the published bf16 weights."""
    log_path = tmp_path / "math_rl_full"
    args = math_rl_args(log_path, "loss_fn=importance_sampling", model="Qwen/Qwen3-32B")
    done = run_recipe(
        "tinker_cookbook.recipes.math_rl.train", args, recipe_env(sdk_env.url, API_KEY, hf_home), tmp_path
    )
    assert done.returncode == 0, done.stdout[-6000:]
    rows = {row["step"]: row for row in read_jsonl(log_path / "metrics.jsonl")}
    for step in (0, 1):
        row = rows[step]
        assert row["env/all/total_episodes"] == 16, row
        for key in ("optim/grad_norm", "optim/kl_sample_train_v1", "env/all/reward/total"):
            assert finite(row[key]), (key, row)
        # the sampler serves the weights rounded to bf16, the trainer computes in float32
        assert abs(row["optim/kl_sample_train_v1"]) < 0.05, row
    run_id = run_id_of(read_jsonl(log_path / "checkpoints.jsonl")[-1]["state_path"])
    run = tinker.RestClient().get_training_run(run_id).result()
    assert run.base_model == "Qwen/Qwen3-32B" and run.is_lora is False and run.lora_rank is None
