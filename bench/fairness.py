"""Fairness under load: a light tenant's step latency while another tenant floods the trainer.

One `openrl serve` (tiny Qwen3 model), two tenants, through the real tinker SDK. Tenant B runs
a light job: a loop of forward_backward + optim_step on one LoRA model (submitted together,
then both awaited, as an SDK loop does). Measured twice in one run: (a) B alone; (b) B while
tenant A floods the server with `--flood` concurrent jobs of the same loop, each on its own
LoRA model (A is heavy by its number of jobs; `--flood-batch` also makes its steps bigger).
The two are measured in alternating phases, `--rounds` of each. Reported: B's per-step
latency p50 / p99 in both, and the ratio of the p99s. Target: B's p99 under the flood
within 2x of B's p99 alone.

    .venv/bin/python bench/fairness.py [--flood 8] [--steps 10] [--rounds 3] [--flood-batch 1] [--seq 32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

MODEL = "openrl/tiny-qwen3"
KEYS = "alice=tml-bench-flood,bob=tml-bench-light"
FLOOD_KEY, LIGHT_KEY = "tml-bench-flood", "tml-bench-light"


def batch(rows: int, seq: int, seed: int):
    from tinker import types

    rng = np.random.default_rng(seed)
    data = []
    for _ in range(rows):
        tokens = rng.integers(100, 5000, size=seq + 1).tolist()
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * seq},
            )
        )
    return data


def training_client(url: str, key: str, seed: int):
    import tinker

    service = tinker.ServiceClient(base_url=url, api_key=key)
    return service.create_lora_training_client(base_model=MODEL, rank=8, seed=seed).result()


def step(training, data) -> float:
    """One SDK step: forward_backward and optim_step submitted together, then both awaited."""
    from tinker import types

    started = time.perf_counter()
    fwdbwd = training.forward_backward(data, "cross_entropy")
    optim = training.optim_step(types.AdamParams(learning_rate=1e-3))
    fwdbwd.result()
    optim.result()
    return time.perf_counter() - started


def light_job(training, steps: int, seq: int) -> list[float]:
    data = batch(1, seq, seed=1)
    step(training, data)  # warm-up, not counted
    return [step(training, data) for _ in range(steps)]


class Flood:
    """Tenant A's jobs: each its own LoRA model, stepping in a loop while `on` is set."""

    def __init__(self, url: str, jobs: int, rows: int, seq: int) -> None:
        self.on, self.stop = threading.Event(), threading.Event()
        self.ready = threading.Barrier(jobs + 1)
        self.idle = [threading.Event() for _ in range(jobs)]
        self.steps = 0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(url, i, rows, seq), daemon=True) for i in range(jobs)]
        for thread in self.threads:
            thread.start()
        self.ready.wait()  # every job has its model and has run one step

    def _run(self, url: str, index: int, rows: int, seq: int) -> None:
        training = training_client(url, FLOOD_KEY, seed=100 + index)
        data = batch(rows, seq, seed=100 + index)
        step(training, data)
        self.ready.wait()
        while not self.stop.is_set():
            self.idle[index].set()
            if not self.on.wait(0.1):
                continue
            self.idle[index].clear()
            step(training, data)
            with self._lock:
                self.steps += 1

    def start(self) -> None:
        for idle in self.idle:
            idle.clear()
        self.on.set()

    def pause(self) -> None:
        """Stop submitting and wait until every job's last step has finished."""
        self.on.clear()
        for idle in self.idle:
            idle.wait(timeout=120)

    def close(self) -> None:
        self.stop.set()
        self.on.clear()
        for thread in self.threads:
            thread.join(timeout=120)


def percentiles(latencies: list[float]) -> dict:
    array = np.asarray(latencies) * 1000
    return {
        "p50_ms": round(float(np.percentile(array, 50)), 1),
        "p99_ms": round(float(np.percentile(array, 99)), 1),
        "steps": len(latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flood", type=int, default=8, help="tenant A's concurrent jobs")
    parser.add_argument("--steps", type=int, default=10, help="tenant B's measured steps in each phase")
    parser.add_argument("--rounds", type=int, default=3, help="alternating (alone, under flood) phase pairs")
    parser.add_argument(
        "--flood-batch", type=int, default=1, help="rows per forward_backward of each flood job (B sends 1)"
    )
    parser.add_argument("--seq", type=int, default=32, help="tokens per row")
    parser.add_argument("--env", action="append", default=[], help="extra server setting, NAME=VALUE (repeatable)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()

    from functions.local_server import LocalServer

    data_dir = Path(tempfile.mkdtemp(prefix="openrl-fairness-"))
    server = LocalServer(
        data_dir,
        [MODEL],
        KEYS,
        extra_env={"OPENRL_SNAPSHOT_EVERY_STEPS": "0", **dict(e.split("=", 1) for e in args.env)},
    ).wait_ready()
    try:
        light = training_client(server.url, LIGHT_KEY, seed=1)
        flood = Flood(server.url, args.flood, args.flood_batch, args.seq)
        alone, loaded, flood_seconds = [], [], 0.0
        # Alternating phases (alone, flooded, alone, flooded, ...): on a shared machine the
        # background load drifts, and alternating spreads that drift over both sides.
        for round_ in range(args.rounds):
            alone += light_job(light, args.steps, args.seq)
            flood.start()
            time.sleep(1.0)  # the flood reaches its steady state
            began = time.perf_counter()
            loaded += light_job(light, args.steps, args.seq)
            flood_seconds += time.perf_counter() - began
            flood.pause()
            print(
                f"round {round_ + 1}: B alone {percentiles(alone[-args.steps :])}, under flood {percentiles(loaded[-args.steps :])}"
            )
        flood_steps = flood.steps
        flood.close()
    finally:
        server.stop()
    report = {
        "alone": percentiles(alone),
        "under_flood": percentiles(loaded),
        "p99_ratio": round(float(np.percentile(loaded, 99) / np.percentile(alone, 99)), 2),
        "p50_ratio": round(float(np.percentile(loaded, 50) / np.percentile(alone, 50)), 2),
        "flood_steps_per_s": round(flood_steps / flood_seconds, 1),
        "settings": vars(args) | {"json": None},
    }
    print(f"B alone: {report['alone']}")
    print(f"B under A's flood ({args.flood} jobs x {args.flood_batch} x {args.seq} tokens): {report['under_flood']}")
    print(f"B's p99 under flood / alone: {report['p99_ratio']}x (target <= 2x); p50: {report['p50_ratio']}x; "
          f"A's flood ran {report['flood_steps_per_s']} steps/s meanwhile")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
