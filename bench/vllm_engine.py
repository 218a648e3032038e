"""The vLLM sampling engine against the torch engine, same batch, side by side in one run.

For each model (the tiny Qwen3 and SmolLM2-135M-Instruct, float32 on both engines), both
engines sample P prompts x N samples x M new tokens at temperature 1 with no top-k/top-p,
forced to exactly M tokens (stop=[]), with the engines' real interfaces
(`SamplerEngine.sample`, `VllmEngine.sample`, the latter through its child process and
pipe, as the sampler worker calls it). Runs alternate A/B (ABBA) so load drift hits both;
medians are reported, and the ratio vLLM / torch (below 1: vLLM faster). The vLLM engine's
start-up (its process, model load, warm-up) is reported apart: it is paid once per weight
set, not per batch. `--adapters K` runs the batch's prompts under K LoRA adapters (round
robin, rank 8 on attention and MLP) on both engines instead of the base model.

    .venv/bin/python bench/vllm_engine.py [--models tiny,smol --prompts 16 --samples 4 --tokens 64 --reps 3 --adapters 0]

Needs `.venv-vllm` (`make vllm`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from functions.compute.models import load_causal_lm, load_tokenizer, materialize
from functions.sampler.engine import SamplerEngine
from functions.sampler.types import SampleJob
from functions.sampler.vllm_engine import VllmEngine, VllmOptions
from openrl_core.catalog import BUILTIN, SMOLLM2_135M, TINY_QWEN3
from openrl_core.params import SamplingParams

MODELS = {"tiny": TINY_QWEN3, "smol": SMOLLM2_135M}
QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea and the wind in the evening.",
    "Explain in simple words why the sky is blue.",
    "List three fruits that are red.",
    "How do I sort a list in Python?",
    "Tell me a story about a brave little fox who lived in a forest.",
    "What is 12 times 12?",
    "Describe a good breakfast.",
]


def make_adapter(files, directory: Path, seed: int) -> dict[str, bytes]:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(load_causal_lm(files), LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.01)
    model.save_pretrained(directory)
    return {name: (directory / name).read_bytes() for name in ("adapter_model.safetensors", "adapter_config.json")}


def bench_model(key: str, args) -> dict:
    files = materialize(BUILTIN[MODELS[key]])
    tokenizer = load_tokenizer(files)
    chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(args.prompts)]
    prompts = [
        list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)["input_ids"]) for c in chats
    ]
    rows = args.prompts * args.samples
    torch_engine = SamplerEngine(files, max_batch_rows=rows)
    started = time.perf_counter()
    vllm_engine = VllmEngine(files, VllmOptions(max_num_seqs=rows, max_loras=max(1, args.adapters), max_lora_rank=8))
    startup = time.perf_counter() - started
    names = [None]
    if args.adapters:
        with tempfile.TemporaryDirectory() as tmp:
            names = [f"adapter{i}" for i in range(args.adapters)]
            for i, name in enumerate(names):
                adapter = make_adapter(files, Path(tmp) / name, i + 1)
                torch_engine.load_adapter(name, adapter)
                vllm_engine.load_adapter(name, adapter)
    params = SamplingParams(max_tokens=args.tokens, stop=[], temperature=1.0)
    jobs = [SampleJob(p, args.samples, params, adapter=names[i % len(names)]) for i, p in enumerate(prompts)]

    def timed(engine) -> float:
        start = time.perf_counter()
        results = engine.sample(jobs)
        elapsed = time.perf_counter() - start
        print(f"  {key} {type(engine).__name__}: {elapsed:.2f} s", file=sys.stderr, flush=True)
        generated = sum(len(s.tokens) for r in results for s in r.sequences)
        if generated != rows * args.tokens:
            raise SystemExit(f"{type(engine).__name__} generated {generated} tokens, expected {rows * args.tokens}")
        return elapsed

    timed(torch_engine), timed(vllm_engine)  # warm-up: allocators, kernels, lazy imports
    times: dict[str, list[float]] = {"torch": [], "vllm": []}
    for rep in range(args.reps):
        order = [("torch", torch_engine), ("vllm", vllm_engine)]
        for name, engine in order if rep % 2 == 0 else order[::-1]:
            times[name].append(timed(engine))
    vllm_engine.close()
    return {"model": key, "startup": startup, **times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smol")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=0, help="LoRA adapters in the batch (0: base model)")
    args = parser.parse_args()
    tokens = args.prompts * args.samples * args.tokens
    reports = []
    for key in args.models.split(","):
        reports.append(bench_model(key, args))
        report(reports, args, tokens)  # each model's line as soon as it is measured


def report(reports: list[dict], args, tokens: int) -> None:
    print(
        f"batch: {args.prompts} prompts x {args.samples} samples x {args.tokens} tokens, temperature 1, float32, "
        f"{'base model' if not args.adapters else f'{args.adapters} LoRA adapters'}; torch threads {torch.get_num_threads()}; "
        f"{args.reps} alternating reps (median)"
    )
    print(
        f"{'model':6} {'torch s':>8} {'vllm s':>8} {'vllm/torch':>10} {'torch tok/s':>11} {'vllm tok/s':>10} {'vllm start s':>12}"
    )
    for r in reports:
        t, v = statistics.median(r["torch"]), statistics.median(r["vllm"])
        print(
            f"{r['model']:6} {t:8.2f} {v:8.2f} {v / t:10.2f} {tokens / t:11.0f} {tokens / v:10.0f} {r['startup']:12.1f}"
        )
        print(
            f"       runs torch {' '.join(f'{x:.2f}' for x in r['torch'])} | vllm {' '.join(f'{x:.2f}' for x in r['vllm'])}"
        )
    sys.stdout.flush()


# VllmEngine starts a child process; the guard keeps any re-import from running the bench again.
if __name__ == "__main__":
    main()
