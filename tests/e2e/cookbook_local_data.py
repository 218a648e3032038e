"""Run a tinker-cookbook 0.6.1 recipe's own `cli_main` with its own CLIConfig (parsed by chz
from `key=value` arguments, as `python -m <recipe>` parses them), where the recipe's one
Hugging Face Hub dataset loader reads a local file instead. Nothing else of the recipe
changes: its defaults, its dataset builder, its training loop.

    python -m tests.e2e.cookbook_local_data dpo <hh-rlhf style .jsonl> key=value...
    python -m tests.e2e.cookbook_local_data distillation <prompts .jsonl> key=value...

`dpo`: `recipes.preference.dpo.train` with its default `dataset=hhh`; Anthropic/hh-rlhf's
rows are {"chosen": "\\n\\nHuman: …\\n\\nAssistant: …", "rejected": …}, which the recipe's
own `hhh_example_to_comparison` parses. `distillation`:
`recipes.distillation.on_policy_distillation` with its default `dataset=deepmath`; DeepMath's
rows are {"question": …}. Neither recipe takes a local dataset on its command line (their
`dataset` is a name matched against a fixed list), hence this one substitution.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path


def _rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def dpo(path: str, argv: list[str]) -> None:
    import chz
    import datasets
    from tinker_cookbook.recipes.preference import datasets as preference_datasets
    from tinker_cookbook.recipes.preference.dpo import train as recipe

    def local(self) -> tuple:
        return datasets.Dataset.from_list(_rows(path)), None

    preference_datasets.HHHComparisonBuilder.get_train_and_test_datasets = local
    recipe.cli_main(chz.entrypoint(recipe.CLIConfig, argv=argv))


def distillation(path: str, argv: list[str]) -> None:
    import chz
    from tinker_cookbook.distillation import datasets as distillation_datasets
    from tinker_cookbook.recipes.distillation import on_policy_distillation as recipe

    def local(split: str = "train") -> list[str] | None:
        return [row["question"] for row in _rows(path)] if split == "train" else None

    distillation_datasets.load_deepmath_prompts = local
    asyncio.run(recipe.cli_main(chz.entrypoint(recipe.CLIConfig, argv=argv)))


if __name__ == "__main__":
    {"dpo": dpo, "distillation": distillation}[sys.argv[1]](sys.argv[2], sys.argv[3:])
