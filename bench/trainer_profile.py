"""Where one trainer step's time goes: torch.profiler over `TrainerEngine.forward_backward` +
`optim_step`, against the same LoRA step written directly with peft, on one device.

Why: on an H200 a SmolLM2 `forward_backward` of 2 x 32 tokens took 0.28 s, far more than its
arithmetic (docs/benchmarks.md, "Four RL jobs"). This prints, for each side, the wall time per step, the
device's busy time per step (the sum of its kernels), how many kernels were launched and how
many times the host waited for the device, and the operators with the most host time, so
one run on a GPU says whether a step is launch-bound, sync-bound or compute-bound.

    .venv/bin/python bench/trainer_profile.py [--device cuda] [--model smol] [--rows 2] [--tokens 32] [--steps 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from packing import MODELS, synchronize

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Host-side calls that wait for the device, by the names the profiler gives them.
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync", "cudaEventSynchronize")


def batch(rows: int, tokens: int, seed: int = 0):
    from openrl_core.datum import Datum

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        ids = rng.integers(100, 20000, size=tokens + 1)
        out.append(
            Datum(
                ids[:-1].astype(np.int64),
                {"target_tokens": ids[1:].astype(np.int64), "weights": np.ones(tokens, np.float32)},
            )
        )
    return out


def trainer_step(files, device: str, data, rank: int):
    from functions.trainer.engine import TrainerEngine
    from openrl_core.params import AdamParams, LoraConfig

    engine = TrainerEngine(files, device=device)
    engine.create_adapter("m", LoraConfig(rank=rank, seed=0, train_unembed=False))

    def step():
        engine.forward_backward("m", data, "cross_entropy", None, False)
        engine.optim_step("m", AdamParams(learning_rate=1e-4))

    return step


def peft_step(files, device: str, data, rank: int):
    from peft import LoraConfig, get_peft_model

    from functions.compute.models import load_causal_lm

    model = get_peft_model(
        load_causal_lm(files, device=device),
        LoraConfig(r=rank, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0),
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    tokens = torch.tensor(np.stack([d.tokens_N for d in data]), device=device)
    targets = torch.tensor(np.stack([d.loss_fn_inputs["target_tokens"] for d in data]), device=device)

    def step():
        logits = model(input_ids=tokens).logits
        loss = -torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    return step


def profile(label: str, step, device: str, steps: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(2):  # warm-up: allocator, kernels chosen, lazy loads
        step()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with torch_profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        wall = (time.perf_counter() - started) / steps
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if getattr(e, "self_device_time_total", 0)) / steps
    launches = (
        sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel")) / steps
    )
    waits = {key: sum(e.count for e in events if e.key == key) / steps for key in WAITS}
    print(f"{label}: wall {wall * 1000:.1f} ms a step; device busy {device_us / 1000:.1f} ms a step "
          f"({100 * device_us / 1e6 / wall:.0f}%); {launches:.0f} kernel launches a step; host waits a step: "
          + ", ".join(f"{k} {v:.0f}" for k, v in waits.items() if v), flush=True)  # fmt: skip
    print(events.table(sort_by="self_cpu_time_total", row_limit=12), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="smol", choices=sorted(MODELS))
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    from functions.compute.models import ModelDirectory
    from openrl_core.catalog import Catalog

    files = ModelDirectory(Catalog.from_names([MODELS[args.model]])).files(MODELS[args.model])
    data = batch(args.rows, args.tokens)
    print(
        f"{MODELS[args.model]} on {args.device}, LoRA rank {args.rank}, {args.rows} x {args.tokens} tokens, {args.steps} profiled steps"
    )
    profile(
        "TrainerEngine forward_backward + optim_step",
        trainer_step(files, args.device, data, args.rank),
        args.device,
        args.steps,
    )
    profile("direct peft step", peft_step(files, args.device, data, args.rank), args.device, args.steps)


if __name__ == "__main__":
    main()
