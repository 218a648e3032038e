"""LoRA adapters in the torch sampler: its own LoRA application against the peft path it replaced.

Both engines are `SamplerEngine`s on the same base (SmolLM2-135M-Instruct unless --model tiny),
side by side in one run, alternating A/B (ABBA) so load drift hits both:

- new: the engine as it is (adapters as tensors, `functions/sampler/lora.py`);
- old: `PeftPath` below, the engine's former adapter code: each load writes the files to a
  temporary directory and injects a LoRA module per target layer with peft
  (`get_peft_model` / `add_adapter` + `load_adapter`); each forward is peft's mixed-adapter
  batch (`adapter_names=`). It lives here only, for this comparison.

Adapters are what the trainer exports (Tinker's LoRA: rank --rank, lora_alpha 32, attention,
MLP and lm_head), each with its own random B. Measured:
(1) `load_adapter` of one more adapter, with 1 and with --loaded adapters already loaded;
(2) `sample()` of one job with an adapter (a 24-token prompt, 4 samples x 8 tokens,
    temperature 1, stop=[] so every row runs 8 tokens), and of four such jobs with four
    different adapters in one call, each against the same job(s) on the base model.
Medians of --reps; ratios old / new (above 1: the new path is faster) and each against base.
A full garbage collection runs before each timed call, outside the clock (see `timed`).

    .venv/bin/python bench/sampler_adapters.py [--model smol --reps 5 --loaded 12 --rank 32]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from functions.compute.models import load_tokenizer, materialize
from functions.sampler.engine import ADAPTER_FILES, SamplerEngine, require_adapter_files, validate_job
from functions.sampler.types import SampleJob
from functions.trainer import adapters as trainer_adapters
from openrl_core.catalog import BUILTIN, SMOLLM2_135M, TINY_QWEN3
from openrl_core.errors import InvalidRequest
from openrl_core.params import LoraConfig, SamplingParams

MODELS = {"tiny": TINY_QWEN3, "smol": SMOLLM2_135M}
TEXT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle, "
    "and tell it in the voice of the sea itself, slowly and with care."
)


class PeftPath(SamplerEngine):
    """The former adapter path: peft modules injected into the base, peft's mixed batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._peft = None
        self._names: dict[str, str] = {}  # caller's key -> peft adapter name
        self._serial = 0

    @property
    def model(self) -> torch.nn.Module:
        return self._model if self._peft is None else self._peft.get_base_model()

    def validate(self, job: SampleJob) -> None:
        validate_job(job, self.files, self.eos_token_ids, self._names)

    def has_adapter(self, key: str) -> bool:
        return key in self._names

    def load_adapter(self, key: str, files: dict[str, bytes]) -> None:
        from peft import PeftConfig, get_peft_model

        require_adapter_files(key, files)
        if key in self._names:
            self.drop_adapter(key)
        with tempfile.TemporaryDirectory(prefix="openrl-adapter-") as tmp:
            for name in ADAPTER_FILES:
                Path(tmp, name).write_bytes(files[name])
            config = PeftConfig.from_pretrained(tmp)
            config.inference_mode = True
            self._serial += 1
            name = self._names[key] = f"adapter{self._serial}"
            if self._peft is None:
                self._peft = get_peft_model(self._model, config, adapter_name=name)
            else:
                self._peft.add_adapter(name, config)
            result = self._peft.load_adapter(tmp, adapter_name=name)
            if result.missing_keys or result.unexpected_keys:
                raise InvalidRequest(f"adapter {key!r} does not fit")
            self._peft.eval()

    def drop_adapter(self, key: str) -> None:
        name = self._names.pop(key, None)
        if name is None or self._peft is None:
            return
        if not self._names:
            self._model = self._peft.unload()
            self._peft = None
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._peft.delete_adapter(name)
            if self._peft.active_adapter not in self._peft.peft_config:
                self._peft.set_adapter(next(iter(self._names.values())))

    def _forward(self, input_ids, attention_mask, position_ids, cache, adapters, logits_to_keep):
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep)  # fmt: skip
        if self._peft is None:
            return self._model(**kwargs).logits
        names = [self._names.get(key, "__base__") if key is not None else "__base__" for key in adapters]
        return self._peft(**kwargs, adapter_names=names).logits


def make_adapters(files, count: int, rank: int) -> list[dict[str, bytes]]:
    """`count` adapters in the trainer's export format, each with its own random lora_B."""
    from peft import get_peft_model

    from functions.compute.models import load_causal_lm

    lora = LoraConfig(rank=rank)
    model = get_peft_model(load_causal_lm(files), trainer_adapters.peft_config(lora, files.name))
    params = trainer_adapters.adapter_parameters(model, "default")
    out = []
    for seed in range(count):
        trainer_adapters.initialize(params, seed)
        generator = torch.Generator().manual_seed(10_000 + seed)
        with torch.no_grad():
            for key, param in params.items():
                if ".lora_B." in key:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
        out.append(trainer_adapters.export_files(params, lora, files.name))
    return out


def timed(fn) -> tuple[float, float]:
    """(wall, CPU) seconds of one call. The peft path's thousands of modules make a full
    garbage collection slow; one runs here, outside the clock, so neither path is billed a
    collection the other caused."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def medians(samples: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def main() -> None:
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")  # tied lm_head, renamed base path
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smol")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--loaded", type=int, default=12)
    parser.add_argument("--rank", type=int, default=32)
    args = parser.parse_args()
    if args.loaded < 4:
        parser.error("--loaded must be at least 4: the four-job case samples adapters a0-a3")
    files = materialize(BUILTIN[MODELS[args.model]])
    prompt = load_tokenizer(files)(TEXT)["input_ids"][:24]
    if len(prompt) != 24:
        raise SystemExit("the bench's text must tokenize to at least 24 tokens")
    adapters = make_adapters(files, args.loaded + 2, args.rank)
    probe = adapters[-1]
    engines = {"old": PeftPath(files), "new": SamplerEngine(files)}
    print(
        f"{files.name}, LoRA rank {args.rank} (attn+mlp+lm_head), torch threads {torch.get_num_threads()}, {args.reps} reps"
    )

    def loads(already: int) -> dict[str, tuple[float, float]]:
        for engine in engines.values():
            for i in range(already):
                if not engine.has_adapter(f"a{i}"):
                    engine.load_adapter(f"a{i}", adapters[i])
        times: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
        for rep in range(args.reps):
            for name in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                engine = engines[name]
                times[name].append(timed(lambda: engine.load_adapter("probe", probe)))
                engine.drop_adapter("probe")
        return {name: medians(values) for name, values in times.items()}

    print("\n(1) load_adapter of one more adapter, median wall seconds (CPU seconds)")
    for already in (1, args.loaded):
        (old, old_cpu), (new, new_cpu) = (t := loads(already))["old"], t["new"]
        print(f"  {already:2d} loaded: old (peft) {old:.4f} s ({old_cpu:.4f})   new {new:.4f} s ({new_cpu:.4f})   "
              f"old/new {old / new:.1f}x (CPU {old_cpu / new_cpu:.1f}x)")  # fmt: skip

    params = SamplingParams(max_tokens=8, temperature=1.0, stop=[], seed=7)

    def jobs(keys) -> list[SampleJob]:
        return [SampleJob(prompt, 4, params, adapter=key) for key in keys]

    print(
        f"\n(2) sample(), 24-token prompt, 4 samples x 8 tokens per job, {args.loaded} adapters loaded, median seconds"
    )
    cases = {"1 job": ["a0"], "4 jobs, 4 adapters": ["a0", "a1", "a2", "a3"]}
    for label, keys in cases.items():
        runs = {
            "old": lambda: engines["old"].sample(jobs(keys)),
            "new": lambda: engines["new"].sample(jobs(keys)),
            "base": lambda: engines["new"].sample(jobs([None] * len(keys))),
        }
        for run in runs.values():
            run()  # warm-up
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        order = list(runs)
        for rep in range(args.reps):
            for name in order if rep % 2 == 0 else order[::-1]:
                times[name].append(timed(runs[name]))
        for column, label_of in ((0, "wall"), (1, "CPU")):
            t = {name: medians(values)[column] for name, values in times.items()}
            print(f"  {label} ({label_of}): old (peft) {t['old']:.3f} s   new {t['new']:.3f} s   base {t['base']:.3f} s   "
                  f"old/new {t['old'] / t['new']:.2f}x   old/base {t['old'] / t['base']:.2f}   "
                  f"new/base {t['new'] / t['base']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
