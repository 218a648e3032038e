"""What an unmodified tinker-cookbook recipe needs from a machine with no model hub.

Recipes choose their chat renderer and tokenizer by model name, and `model_info` knows
`Qwen/Qwen3-8B` (renderer `qwen3`) and `Qwen/Qwen3-8B-Base` (`role_colon`) but not
`openrl/tiny-qwen3`. So the server serves the tiny model under those two names as well
(`OPENRL_MODEL_ALIASES`, `COOKBOOK_ALIASES` below), and `populate_hf_cache` puts the tiny
model's tokenizer, the real Qwen BPE with Qwen3's special tokens, into a Hugging Face cache
under the same names, laid out as the hub would (protocol notes §12.1), so
`AutoTokenizer.from_pretrained("Qwen/Qwen3-8B")` resolves with `HF_HUB_OFFLINE=1`.
Both names are Qwen3 models, whose vocabulary is the one the tiny model was built with.
`run_recipe` then runs a recipe module as a researcher would: `python -m <module> key=value…`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

from openrl_core.catalog import TINY_QWEN3

COOKBOOK_ALIASES = {"Qwen/Qwen3-8B": TINY_QWEN3, "Qwen/Qwen3-8B-Base": TINY_QWEN3, "Qwen/Qwen3-32B": TINY_QWEN3}
# Served names whose runs are full fine-tuning (OPENRL_FULL_FINETUNE_MODELS): a recipe asks
# for a LoRA client by name and gets a full run, unchanged. Qwen3-32B uses the qwen3 renderer.
FULL_FINETUNE_NAMES = ["Qwen/Qwen3-32B"]
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
)


def populate_hf_cache(hf_home: Path, names: list[str], model_dir: Path) -> Path:
    """Put `model_dir`'s tokenizer into `hf_home` under each hub name; returns `hf_home`.

    transformers 5 reads `config.json` to pick the tokenizer class, so it travels too.
    """
    for name in names:
        org, model = name.split("/")
        repo = hf_home / "hub" / f"models--{org}--{model}"
        revision = hashlib.sha1(name.encode()).hexdigest()  # any 40 hex digits will do
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        for filename in TOKENIZER_FILES:
            if (model_dir / filename).exists():
                shutil.copy(model_dir / filename, snapshot / filename)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    return hf_home


def recipe_env(server_url: str, api_key: str, hf_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        TINKER_BASE_URL=server_url,
        TINKER_API_KEY=api_key,
        TINKER_TELEMETRY="0",
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_recipe(
    module: str, args: list[str], env: dict[str, str], cwd: Path, timeout: float = 240
) -> subprocess.CompletedProcess:
    """`python -m module args…`; stdout and stderr together in `.stdout`."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def run_id_of(tinker_path: str) -> str:
    """`tinker://<run>/weights/<name>` -> `<run>`."""
    return tinker_path.removeprefix("tinker://").split("/")[0]
