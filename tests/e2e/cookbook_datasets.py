"""A Hugging Face datasets cache holding a small local stand-in for `openai/gsm8k` ("main").

`recipes.rl_loop` calls `datasets.load_dataset("openai/gsm8k", "main")`, which with
`HF_DATASETS_OFFLINE=1` resolves from the datasets cache, laid out as
`<cache>/openai___gsm8k/main/<version>/<hash>/gsm8k-<split>.arrow` beside a
`dataset_info.json` whose `config_name` is the directory's (datasets' `Cache` builder,
`packaged_modules/cache`). `populate_gsm8k_cache` builds those files from GSM8K-shaped rows
(a question; an answer ending in `#### <number>`, which the recipe's grader reads) with
datasets' own json builder, then files them under the hub name, so the recipe loads them
unchanged.
"""

from __future__ import annotations

import glob
import json
import shutil
from pathlib import Path


def gsm8k_rows() -> list[dict]:
    """Additions of one-digit numbers, in GSM8K's answer format."""
    return [
        {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
        for a in range(1, 10)
        for b in range(1, 10)
    ]


def populate_gsm8k_cache(root: Path) -> Path:
    """Build the cache under `root`; returns the directory to give as HF_DATASETS_CACHE."""
    import datasets

    source = root / "source"
    source.mkdir(parents=True, exist_ok=True)
    rows = gsm8k_rows()
    files = {"train": source / "train.jsonl", "test": source / "test.jsonl"}
    files["train"].write_text("\n".join(json.dumps(row) for row in rows))
    files["test"].write_text("\n".join(json.dumps(row) for row in rows[:8]))
    work = root / "build"
    datasets.load_dataset("json", data_files={k: str(v) for k, v in files.items()}, cache_dir=str(work))
    (built,) = [Path(p) for p in glob.glob(str(work / "json" / "*" / "*" / "*")) if Path(p).is_dir()]
    cache = root / "cache"
    target = cache / "openai___gsm8k" / "main" / "0.0.0" / built.name
    target.mkdir(parents=True)
    for path in built.iterdir():
        if path.suffix == ".arrow":
            shutil.copy(path, target / path.name.replace("json-", "gsm8k-", 1))
        elif path.name == "dataset_info.json":
            info = json.loads(path.read_text())
            info.update(config_name="main", builder_name="gsm8k", dataset_name="gsm8k")
            (target / path.name).write_text(json.dumps(info))
    return cache
