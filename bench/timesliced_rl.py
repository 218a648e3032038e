"""Three RL jobs on one accelerator: one after another, against all at once through the timeslicer.

The jobs (two tenants): two full fine-tuning runs (alice) and one LoRA run (bob), on the tiny
Qwen3 model, through the real tinker SDK against one `openrl serve` whose timeslicer has a
memory budget smaller than the three jobs' device state together (so jobs park). Each RL step
samples a group (seeded), grades it in an "environment" that takes about twice a training
step's compute (a sleep standing for a judge or a sandbox elsewhere), trains with
importance_sampling (AdamW, lr 1e-5 full, 1e-3 LoRA) and publishes the new weights to its
sampler (a sparse delta for full runs), the three requests submitted together as an async
RL loop does.

(a) one after another: each job alone in turn; (b) at once: the three concurrently. Reported
from the timeslicer: accelerator duty cycle (share of the wall time some job held the device),
wall time, context switches, park/restore time per switch; and each job's learning curve,
which must be bitwise the same in both modes (on CPU). Targets: duty cycle at least 2x the
one-after-another run's, wall time at most 0.5x.

    .venv/bin/python bench/timesliced_rl.py [--steps 6] [--budget 700MiB]
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
KEYS = "alice=tml-bench-alice,bob=tml-bench-bob"
JOBS = [
    {"name": "full-A", "key": "tml-bench-alice", "full": True, "seed": 11},
    {"name": "full-B", "key": "tml-bench-alice", "full": True, "seed": 22},
    {"name": "lora-C", "key": "tml-bench-bob", "full": False, "seed": 33},
]
# One sampling request per step (a prompt and its group): a request is sampled in a batch of its
# own, so its tokens and logprobs do not depend on what else the sampler had queued.
GROUP, PROMPTS, MAX_TOKENS = 8, 1, 8
BATCH_LENGTH = 96  # tokens per training sequence: prompt + completion, padded by repeating the prompt


def grade(tokens: list[int]) -> float:
    """A deterministic stand-in reward: the share of even token ids."""
    return sum(1 for t in tokens if t % 2 == 0) / max(1, len(tokens))


def run_job(url: str, job: dict, steps: int, env_seconds: float, out: dict) -> None:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=job["key"])
    metadata = {"openrl.full_finetune": "true"} if job["full"] else None
    training = service.create_lora_training_client(
        base_model=MODEL, rank=8, seed=job["seed"], user_metadata=metadata
    ).result()
    rng = np.random.default_rng(job["seed"])
    prompts = [rng.integers(100, 5000, size=BATCH_LENGTH - MAX_TOKENS).tolist() for _ in range(PROMPTS)]
    sampler = training.save_weights_and_get_sampling_client().result()
    curve, step_times, phases = [], [], []
    for step in range(steps):
        started = time.perf_counter()
        marks = {"sample": time.time()}
        futures = [
            sampler.sample(types.ModelInput.from_ints(p), num_samples=GROUP,
                           sampling_params=types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=job["seed"] * 1000 + step * 10 + i))
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        results = [f.result() for f in futures]
        marks["grade"] = time.time()
        time.sleep(env_seconds)  # the environment grades the batch elsewhere
        marks["train"] = time.time()
        data, rewards, sampled_logprob = [], [], 0.0
        for prompt, result in zip(prompts, results):
            group = [grade(seq.tokens) for seq in result.sequences]
            baseline = sum(group) / len(group)
            rewards += group
            for seq, reward in zip(result.sequences, group):
                sampled_logprob += sum(seq.logprobs)
                tokens = prompt + seq.tokens
                n, ob = len(tokens) - 1, len(prompt) - 1
                logprobs = [0.0] * ob + list(seq.logprobs)
                advantages = [0.0] * ob + [reward - baseline] * len(seq.tokens)
                data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": logprobs[:n], "advantages": advantages[:n]}))  # fmt: skip
        # submitted together, as an async RL loop does: the trainer runs them in one turn
        fb = training.forward_backward(data, "importance_sampling")
        opt = training.optim_step(types.AdamParams(learning_rate=1e-5 if job["full"] else 1e-3))
        next_sampler = training.save_weights_and_get_sampling_client()
        trained = fb.result()
        loss = trained.metrics["loss:sum"]
        train_logprob = float(
            sum(out["logprobs"].to_numpy().astype(np.float64).sum() for out in trained.loss_fn_outputs)
        )
        opt.result()
        sampler = next_sampler.result()
        marks["done"] = time.time()
        phases.append(marks)
        curve.append(
            {
                "loss": loss,
                "reward": float(np.mean(rewards)),
                "sampled_logprob": sampled_logprob,
                "train_logprob": train_logprob,
            }
        )
        step_times.append(time.perf_counter() - started)
    out[job["name"]] = {"curve": curve, "step_seconds": step_times, "phases": phases}
    service.close("success").result()


def status(socket: Path) -> dict:
    from functions.timeslicer.cli import _ask

    return _ask(socket, {"op": "status", "id": 1})["status"]["devices"][0]


def timeline(socket: Path, since: float) -> list[dict]:
    from functions.timeslicer.cli import _ask

    return next(iter(_ask(socket, {"op": "timeline", "id": 1, "since": since})["timeline"].values()))


def measure(url: str, socket: Path, jobs: list[dict], steps: int, env_seconds: float, concurrent: bool) -> dict:
    before, started, wall_start = status(socket), time.perf_counter(), time.time()
    out: dict = {}
    if concurrent:
        threads = [threading.Thread(target=run_job, args=(url, job, steps, env_seconds, out)) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for job in jobs:
            run_job(url, job, steps, env_seconds, out)
    wall = time.perf_counter() - started
    after = status(socket)
    delta = {k: after[k] - before[k] for k in ("busy_seconds", "switches", "parks", "park_seconds", "park_bytes",
                                               "restores", "restore_seconds", "restore_bytes")}  # fmt: skip
    return {"wall": wall, "duty_cycle": delta["busy_seconds"] / wall, **delta, "jobs": out,
            "window": [wall_start, wall_start + wall], "timeline": timeline(socket, wall_start)}  # fmt: skip


def calibrate(url: str) -> float:
    """Seconds of one full fine-tuning step's compute (forward_backward + optim_step) alone."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=JOBS[0]["key"])
    training = service.create_lora_training_client(
        base_model=MODEL, user_metadata={"openrl.full_finetune": "true"}
    ).result()
    rng = np.random.default_rng(0)
    data = [types.Datum(model_input=types.ModelInput.from_ints(rng.integers(100, 5000, BATCH_LENGTH - 1).tolist()),
                        loss_fn_inputs={"target_tokens": rng.integers(100, 5000, BATCH_LENGTH - 1).tolist()})
            for _ in range(GROUP * PROMPTS)]  # fmt: skip
    times = []
    for _ in range(4):
        started = time.perf_counter()
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-6)).result()
        times.append(time.perf_counter() - started)
    service.close("success").result()
    return float(np.median(times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--budget", default="700MiB", help="the accelerator memory budget (smaller than the three jobs' state)"
    )
    parser.add_argument(
        "--affinity", type=float, default=None, help="OPENRL_TIMESLICER_AFFINITY_SECONDS (default: the setting's)"
    )
    parser.add_argument("--policy", default="lrs", choices=("fifo", "lrs"))
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()

    from functions.local_server import LocalServer
    from functions.timeslicer.setup import UNIX_PATH_MAX

    data_dir = Path(tempfile.mkdtemp(prefix="openrl-ts-bench-"))
    env = {
        "OPENRL_ACCELERATOR_MEMORY": args.budget,
        "OPENRL_TIMESLICER_POLICY": args.policy,
        "OPENRL_SNAPSHOT_EVERY_STEPS": "0",
    }
    if args.affinity is not None:
        env["OPENRL_TIMESLICER_AFFINITY_SECONDS"] = str(args.affinity)
    server = LocalServer(data_dir, [MODEL], KEYS, extra_env=env).wait_ready()
    socket = data_dir.resolve() / "timeslicer.sock"
    assert len(str(socket)) <= UNIX_PATH_MAX
    try:
        step = calibrate(server.url)
        env_seconds = 2 * step
        print(
            f"a full fine-tuning step's compute: {step:.2f} s; the environment grades each batch in {env_seconds:.2f} s"
        )
        # the same order both times, so a job's sampler and trainer state are as big in each mode
        sequential = measure(server.url, socket, JOBS, args.steps, env_seconds, concurrent=False)
        concurrent = measure(
            server.url, socket, [dict(j, seed=j["seed"]) for j in JOBS], args.steps, env_seconds, concurrent=True
        )
        final = status(socket)
    finally:
        server.stop()

    print(
        f"\nbudget {args.budget}, policy {args.policy}, affinity {args.affinity if args.affinity is not None else 'default'}; per job {args.steps} RL steps of {PROMPTS} prompts x {GROUP} samples x {MAX_TOKENS} tokens"
    )
    print("resident jobs at the end: " + ", ".join(f"{r['job'].split('/', 1)[1]} {r['bytes'] / 2**20:.0f} MiB"
                                                   f"{' (parked)' if r['parked'] else ''}" for r in final["residents"]))  # fmt: skip
    print(f"\n{'':<24}{'one after another':>20}{'at once':>14}{'ratio':>10}")
    for label, key, fmt in (("wall time (s)", "wall", "{:.1f}"), ("duty cycle", "duty_cycle", "{:.1%}"),
                            ("context switches", "switches", "{:.0f}"), ("parks", "parks", "{:.0f}"),
                            ("restores", "restores", "{:.0f}")):  # fmt: skip
        a, b = sequential[key], concurrent[key]
        ratio = f"{b / a:.2f}x" if a else "-"
        print(f"{label:<24}{fmt.format(a):>20}{fmt.format(b):>14}{ratio:>10}")
    for mode, result in (("one after another", sequential), ("at once", concurrent)):
        switches = max(1, result["switches"])
        print(f"{mode}: park {result['park_seconds'] / switches * 1000:.1f} ms and restore "
              f"{result['restore_seconds'] / switches * 1000:.1f} ms per switch on average "
              f"({result['parks']} parks, {result['park_bytes'] / 2**20:.0f} MiB; {result['restores']} restores)")  # fmt: skip
    print("\nlearning curves (loss, mean reward per step):")
    same = True
    for job in JOBS:
        a, b = sequential["jobs"][job["name"]]["curve"], concurrent["jobs"][job["name"]]["curve"]
        identical = a == b
        same &= identical
        print(
            f"  {job['name']}: {'bitwise identical' if identical else 'DIFFERENT'} "
            f"loss {a[0]['loss']:.4f} -> {a[-1]['loss']:.4f}, reward {a[0]['reward']:.3f} -> {a[-1]['reward']:.3f}"
        )
    print(
        f"\nduty cycle {concurrent['duty_cycle'] / sequential['duty_cycle']:.2f}x (target >= 2), "
        f"wall {concurrent['wall'] / sequential['wall']:.2f}x (target <= 0.5), curves {'identical' if same else 'DIFFER'}"
    )
    if args.json:
        args.json.write_text(json.dumps({"sequential": sequential, "concurrent": concurrent, "budget": args.budget,
                                         "step_seconds": step, "env_seconds": env_seconds}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
