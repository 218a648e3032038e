"""Where `openrl serve`'s memory goes during a LoRA training + sampling loop, phase by phase.

Starts `openrl serve` on one model, drives a loop like `make demo` with the tinker SDK
(create a LoRA, then N x (forward_backward + optim_step + save_weights_and_get_sampling_client
+ sample)), and after each phase prints the server's VmRSS, VmHWM (peak), RssAnon and RssFile
from /proc/PID/status, plus the data directory's size. The expected bytes are printed beside
them: float32 base weights (one copy), the adapter with its gradients and Adam moments.

    .venv/bin/python bench/serve_memory.py                       # SmolLM2-135M, 20 steps
    .venv/bin/python bench/serve_memory.py --model openrl/tiny-qwen3 --steps 40
    .venv/bin/python bench/serve_memory.py --env MALLOC_ARENA_MAX=2   # an allocator setting

Not a timing: the numbers are sizes, which another load on the machine does not change.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

MIB = 1 << 20


def status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of a process, in bytes."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            values[name] = int(rest.split()[0]) * 1024
    return values


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="datums per forward_backward (the demo's batch)")
    parser.add_argument("--seq", type=int, default=24, help="tokens per datum (the demo's are ~20)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8, help="sample requests per step, 16 tokens each")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server process")
    parser.add_argument(
        "--idle-seconds", type=float, default=1.5, help="wait this long before each reading (the idle trim)"
    )
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()

    import tinker
    from tinker import types

    from functions.compute.models import materialize, parameter_count
    from functions.local_server import LocalServer
    from openrl_core.catalog import BUILTIN

    files = materialize(BUILTIN[args.model])
    vocab = files.vocab_size
    weights = parameter_count(files) * 4
    extra_env = dict(item.split("=", 1) for item in args.env)
    rows: list[dict] = []
    rng = random.Random(0)

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        with LocalServer(data_dir, [args.model], "tml-bench", extra_env=extra_env) as server:
            pid = server.process.pid

            def record(phase: str) -> None:
                # The workers give freed memory back once the process has been idle a moment
                # (release_host_memory_idle_ms, 1 s): read what an idle server holds.
                time.sleep(args.idle_seconds)
                row = {"phase": phase, **status(pid), "data_dir": tree_bytes(data_dir)}
                rows.append(row)
                print(
                    f"{phase:<28} rss {row['VmRSS'] / MIB:8.0f} MiB  peak {row['VmHWM'] / MIB:8.0f} MiB  "
                    f"anon {row['RssAnon'] / MIB:8.0f}  file {row['RssFile'] / MIB:6.0f}  data {row['data_dir'] / MIB:7.1f} MiB",
                    flush=True,
                )

            record("started")
            service = tinker.ServiceClient(base_url=server.url, api_key="tml-bench")
            training = service.create_lora_training_client(base_model=args.model, rank=args.rank, seed=0).result()
            record("lora created")
            adam = types.AdamParams(learning_rate=1e-4)
            params = types.SamplingParams(max_tokens=16, temperature=1.0, seed=1)
            for step in range(1, args.steps + 1):
                batch = []
                for _ in range(args.batch):
                    tokens = [rng.randrange(vocab) for _ in range(args.seq + 1)]
                    batch.append(
                        types.Datum(
                            model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * args.seq},
                        )
                    )
                fb = training.forward_backward(batch, "cross_entropy")
                opt = training.optim_step(adam)
                fb.result()
                opt.result()
                if step == 1:
                    record("step 1 trained")
                sampler = training.save_weights_and_get_sampling_client().result()
                futures = [
                    sampler.sample(
                        prompt=types.ModelInput.from_ints([rng.randrange(vocab) for _ in range(12)]),
                        num_samples=1,
                        sampling_params=params,
                    )  # fmt: skip
                    for _ in range(args.samples)
                ]
                for future in futures:
                    future.result()
                if step in (1, 5, 10) or step == args.steps or step % 10 == 0:
                    record(f"step {step} trained+sampled")
            service.close("success").result()

    adapter = next(r for r in rows if r["phase"] == "lora created")
    print(f"\n{args.model}: float32 base weights {weights / MIB:.0f} MiB per copy; {args.steps} steps of "
          f"{args.batch} x {args.seq} tokens, rank {args.rank}, {args.samples} samples per step")  # fmt: skip
    print(f"idle after start {rows[0]['VmRSS'] / MIB:.0f} MiB; after LoRA create {adapter['VmRSS'] / MIB:.0f} MiB; "
          f"final {rows[-1]['VmRSS'] / MIB:.0f} MiB, peak {rows[-1]['VmHWM'] / MIB:.0f} MiB")  # fmt: skip
    step5 = next((r for r in rows if r["phase"] == "step 5 trained+sampled"), None)
    if step5 is not None:
        print(f"RSS growth from step 5 to step {args.steps}: {(rows[-1]['VmRSS'] - step5['VmRSS']) / MIB:+.0f} MiB; "
              f"data dir {step5['data_dir'] / MIB:.1f} -> {rows[-1]['data_dir'] / MIB:.1f} MiB")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "weights": weights, "rows": rows}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    main()
