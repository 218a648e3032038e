"""SamplerEngine.sample against plain HF `model.generate` on SmolLM2-135M, same batch.

Both sample P prompts x N samples x M new tokens at temperature 1 with no top-k/top-p,
and both are forced to generate exactly M tokens (stop=[] for the engine, min_new_tokens
for HF), so they do the same amount of model work except what the engine saves by design
(one prefill per prompt instead of one per sample) and its own per-step overhead. Runs
alternate A/B in one process so drift in machine load hits both; medians are reported.

    .venv/bin/python bench/sampler_vs_hf_generate.py [--prompts 4 --samples 4 --tokens 32 --reps 5 --threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from functions.compute.models import load_causal_lm, load_tokenizer, materialize
from functions.sampler.engine import SamplerEngine
from functions.sampler.types import SampleJob
from openrl_core.catalog import BUILTIN, SMOLLM2_135M
from openrl_core.params import SamplingParams

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    # On a small shared CPU box, OpenMP threads spinning against other processes make both
    # sides erratic; --threads 1 gives steadier numbers there.
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    files = materialize(BUILTIN[SMOLLM2_135M])
    tokenizer = load_tokenizer(files)
    tokenizer.padding_side = "left"
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.prompts)]
    chats = [[{"role": "user", "content": q}] for q in questions]
    prompts = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"]) for c in chats]
    engine = SamplerEngine(files, device=args.device, max_batch_rows=args.prompts * args.samples)
    model = load_causal_lm(files, device=args.device).eval()
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(args.device)
    jobs = [
        SampleJob(p, args.samples, SamplingParams(max_tokens=args.tokens, stop=[], temperature=1.0)) for p in prompts
    ]

    def run_engine() -> int:
        results = engine.sample(jobs)
        return sum(len(s.tokens) for r in results for s in r.sequences)

    def run_hf() -> int:
        with torch.inference_mode():
            out = model.generate(
                **batch,
                do_sample=True,
                num_return_sequences=args.samples,
                max_new_tokens=args.tokens,
                min_new_tokens=args.tokens,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=tokenizer.pad_token_id,
            )
        return out[:, batch["input_ids"].shape[1] :].numel()

    def timed(fn) -> float:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        generated = fn()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        expected = args.prompts * args.samples * args.tokens
        if generated != expected:
            raise SystemExit(f"{fn.__name__} generated {generated} tokens, expected {expected}")
        return elapsed

    timed(run_engine), timed(run_hf)  # warm-up: allocator, kernels, lazy imports
    engine_s, hf_s = [], []
    for rep in range(args.reps):
        order = [(run_engine, engine_s), (run_hf, hf_s)]
        for fn, times in order if rep % 2 == 0 else order[::-1]:
            times.append(timed(fn))
    engine_med, hf_med = statistics.median(engine_s), statistics.median(hf_s)
    print(
        f"device={args.device} threads={torch.get_num_threads()} batch={args.prompts} prompts x "
        f"{args.samples} samples x {args.tokens} tokens, {args.reps} alternating reps"
    )
    print("engine runs (s): " + " ".join(f"{t:.3f}" for t in engine_s))
    print("hf     runs (s): " + " ".join(f"{t:.3f}" for t in hf_s))
    print(
        f"median engine {engine_med:.3f} s, median HF generate {hf_med:.3f} s, ratio engine/HF {engine_med / hf_med:.3f}"
    )


if __name__ == "__main__":
    main()
