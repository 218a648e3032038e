"""Several tenants' LoRA models in one pass against one after another, side by side.

(a) Engine: 8 LoRA models (ranks 8-32) on one base model, one forward_backward each, run by
    `TrainerEngine.forward_backward_many` as shared passes (bitwise as alone) against 8
    `forward_backward` calls one after another; small requests (2 x 32 tokens each) and large
    ones (8 x 128 each). Alternating A/B; medians and the median of the pair ratios.
(b) Service: 4 RL jobs (sample a group, grade with a small environment latency, train,
    publish) through the tinker SDK against `openrl serve`, all at once against one job
    alone: aggregate steps per second.

Targets: (a) small >= 1.5x on SmolLM2, large >= 0.95x; (b) >= 2.5x.

    .venv/bin/python bench/packing.py [--models tiny,smol] [--rounds 5] [--skip-engine] [--skip-service] [--device cuda]

(b) also runs the 4 jobs with packing switched off (OPENRL_TRAINER_PACKING=false), to show what
the shared passes add on top of overlapping one job's environment wait with another's compute.
`--floor` prints the compute (b)'s work needs at best: the engines alone, in this process, on
the same sizes (one job's sample, train, step and export; then the four jobs' as one sampler
batch and one packed pass), and the aggregate rate that would give against one job's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

MODELS = {"tiny": "openrl/tiny-qwen3", "smol": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def requests(rows: int, length: int, seed: int = 0):
    from functions.trainer.engine import PackRequest
    from openrl_core.datum import Datum

    rng = np.random.default_rng(seed)
    out = []
    for model in range(8):
        batch = []
        for _ in range(rows):
            tokens = rng.integers(100, 20000, size=length + 1)
            batch.append(Datum(tokens[:-1].astype(np.int64), {"target_tokens": tokens[1:].astype(np.int64),
                                                               "weights": np.ones(length, np.float32)}))  # fmt: skip
        out.append(PackRequest(f"m{model}", batch, "cross_entropy", None, False))
    return out


def synchronize(device: str) -> None:
    """Wait for queued accelerator work, so a timer stops when the work is done, not launched."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine_bench(name: str, rounds: int, sizes: tuple[str, ...] = ("small", "large"), device: str = "cpu") -> None:
    import torch

    from functions.compute.models import ModelDirectory
    from functions.trainer.engine import TrainerEngine
    from openrl_core.catalog import Catalog
    from openrl_core.params import LoraConfig

    engine = TrainerEngine(ModelDirectory(Catalog.from_names([name])).files(name), device=device)
    for i in range(8):
        engine.create_adapter(f"m{i}", LoraConfig(rank=(8, 16, 32)[i % 3], seed=i))
    for label, rows, length in (
        ("small (8 models x 2 x 32 tokens)", 2, 32),
        ("large (8 models x 8 x 128 tokens)", 8, 128),
    ):
        if label.split()[0] not in sizes:
            continue
        batch = requests(rows, length)
        packed_t, alone_t = [], []
        for _ in range(rounds + 1):
            for model in range(8):
                for p in engine._adapters[f"m{model}"].params.values():
                    p.grad = None
            synchronize(device)
            started = time.perf_counter()
            engine.forward_backward_many(batch)
            synchronize(device)
            packed_t.append(time.perf_counter() - started)
            for model in range(8):
                for p in engine._adapters[f"m{model}"].params.values():
                    p.grad = None
            synchronize(device)
            started = time.perf_counter()
            for r in batch:
                engine.forward_backward(r.model_id, r.batch, r.loss_fn, r.loss_fn_config, r.forward_only)
            synchronize(device)
            alone_t.append(time.perf_counter() - started)
        packed_t, alone_t = packed_t[1:], alone_t[1:]  # the first round warms caches up
        ratio = statistics.median(a / p for a, p in zip(alone_t, packed_t))
        print(f"{name:<38} [{device}] {label:<36} packed {statistics.median(packed_t):6.3f} s  one by one "
              f"{statistics.median(alone_t):6.3f} s  speed-up {ratio:.2f}x  (threads {torch.get_num_threads()})", flush=True)  # fmt: skip


SERVICE_MODEL = MODELS["smol"]
RL_JOBS = 4
GROUP, PROMPT_TOKENS, MAX_TOKENS = 4, 24, 8


def rl_job(url: str, key: str, seed: int, steps: int, env_seconds: float, out: dict) -> None:
    """An RL loop as a researcher writes it: sample a group, grade (the environment takes
    `env_seconds`), importance_sampling forward_backward + optim_step, publish the weights."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model=SERVICE_MODEL, rank=8, seed=seed).result()
    rng = np.random.default_rng(seed)
    sampler = training.save_weights_and_get_sampling_client().result()
    rewards = []
    for step in range(steps):
        prompt = rng.integers(100, 20000, size=PROMPT_TOKENS).tolist()
        result = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=GROUP,
                                sampling_params=types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed * 1000 + step)).result()  # fmt: skip
        time.sleep(env_seconds)
        group = [sum(1 for t in seq.tokens if t % 2 == 0) / max(1, len(seq.tokens)) for seq in result.sequences]
        baseline = sum(group) / len(group)
        data = []
        for seq, reward in zip(result.sequences, group):
            tokens = prompt + seq.tokens
            n, ob = len(tokens) - 1, len(prompt) - 1
            data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": tokens[1:], "logprobs": ([0.0] * ob + list(seq.logprobs))[:n],
                "advantages": ([0.0] * ob + [reward - baseline] * len(seq.tokens))[:n]}))  # fmt: skip
        fb = training.forward_backward(data, "importance_sampling")
        opt = training.optim_step(types.AdamParams(learning_rate=1e-3))
        next_sampler = training.save_weights_and_get_sampling_client()
        fb.result(), opt.result()
        sampler = next_sampler.result()
        rewards.append(float(np.mean(group)))
    out[seed] = rewards
    service.close("success").result()


def rl_run(url: str, jobs: int, steps: int, env_seconds: float) -> float:
    """Aggregate RL steps per second of `jobs` concurrent jobs (two tenants)."""
    import threading

    out: dict = {}
    keys = ["tml-bench-alice", "tml-bench-bob"]
    threads = [
        threading.Thread(target=rl_job, args=(url, keys[i % 2], 100 + i, steps, env_seconds, out)) for i in range(jobs)
    ]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    assert len(out) == jobs, "a job failed"
    return jobs * steps / wall


def service_bench(steps: int, env_seconds: float, modes: tuple[str, ...] = ("on", "off"), device: str = "cpu") -> None:
    import tempfile
    from pathlib import Path

    from functions.local_server import LocalServer

    keys = "alice=tml-bench-alice,bob=tml-bench-bob"
    rows = {}
    for label, packing in (("packing on", "true"), ("packing off", "false")):
        if label.split()[1] not in modes:
            continue
        server = LocalServer(Path(tempfile.mkdtemp(prefix="openrl-pack-bench-")), [SERVICE_MODEL], keys,
                             extra_env={"OPENRL_TRAINER_PACKING": packing, "OPENRL_SNAPSHOT_EVERY_STEPS": "0", "OPENRL_DEVICE": device}).wait_ready()  # fmt: skip
        try:
            rl_run(server.url, 1, 2, env_seconds)  # warm-up: the base model loads, kernels warm
            one = rl_run(server.url, 1, steps, env_seconds)
            many = rl_run(server.url, RL_JOBS, steps, env_seconds)
        finally:
            server.stop()
        rows[label] = (one, many)
        print(f"{SERVICE_MODEL} [{device}] RL ({label}), {GROUP} samples x {MAX_TOKENS} tokens, environment {env_seconds:.2f} s: "
              f"1 job {one:.3f} steps/s, {RL_JOBS} jobs {many:.3f} steps/s together: {many / one:.2f}x", flush=True)  # fmt: skip
    if len(rows) == 2:
        on, off = rows["packing on"][1], rows["packing off"][1]
        print(f"{RL_JOBS} jobs, packing on against off: {on / off:.2f}x aggregate steps/s")


def floor_bench(env_seconds: float, reps: int = 4, device: str = "cpu") -> None:
    """The engines alone on (b)'s work: the least device time one RL round of 1 and of 4 jobs needs."""
    import torch

    from functions.compute.models import ModelDirectory
    from functions.sampler.engine import SamplerEngine
    from functions.sampler.types import SampleJob
    from functions.trainer.engine import PackRequest, TrainerEngine
    from openrl_core.catalog import Catalog
    from openrl_core.datum import Datum
    from openrl_core.params import AdamParams, LoraConfig, SamplingParams

    files = ModelDirectory(Catalog.from_names([SERVICE_MODEL])).files(SERVICE_MODEL)
    trainer = TrainerEngine(files, device=device)
    sampler = SamplerEngine(files, device=device, share_base=True)
    rng = np.random.default_rng(0)
    for i in range(RL_JOBS):
        trainer.create_adapter(f"m{i}", LoraConfig(rank=8, seed=100 + i))
        sampler.load_adapter(f"a{i}", trainer.export_adapter(f"m{i}"))

    def data():
        out = []
        for _ in range(GROUP):
            tokens = rng.integers(100, 20000, size=PROMPT_TOKENS + MAX_TOKENS)
            advantages = np.concatenate([np.zeros(PROMPT_TOKENS - 1), rng.normal(size=MAX_TOKENS)]).astype(np.float32)
            out.append(Datum(tokens[:-1].astype(np.int64), {"target_tokens": tokens[1:].astype(np.int64),
                             "logprobs": np.zeros(len(tokens) - 1, np.float32), "advantages": advantages}))  # fmt: skip
        return out

    def job(i):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i)
        return SampleJob(
            prompt_tokens=rng.integers(100, 20000, size=PROMPT_TOKENS).tolist(),
            num_samples=GROUP,
            params=params,
            adapter=f"a{i}",
        )

    def timed(fn):
        times = []
        for _ in range(reps + 1):
            synchronize(device)
            started = time.perf_counter()
            fn()
            synchronize(device)
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

    def step(models):
        for i in models:
            trainer.optim_step(f"m{i}", AdamParams(learning_rate=1e-3))
            sampler.load_adapter(f"a{i}", trainer.export_adapter(f"m{i}"))

    rows = {}
    for n in (1, RL_JOBS):
        sample = timed(lambda: sampler.sample([job(i) for i in range(n)]))
        train = timed(
            lambda: trainer.forward_backward_many(
                [PackRequest(f"m{i}", data(), "importance_sampling", None, False) for i in range(n)]
            )
        )
        publish = timed(lambda: step(range(n)))
        rows[n] = sample + train + publish
        print(f"{SERVICE_MODEL} [{device}] floor, {n} job(s) in one batch and one pass: sample {sample:.3f} s, forward_backward "
              f"{train:.3f} s, optim_step + export + sampler load {publish:.3f} s: {rows[n]:.3f} s a round "
              f"(threads {torch.get_num_threads()})", flush=True)  # fmt: skip
    print(f"at best, with no environment wait and nothing idle: {RL_JOBS} jobs {RL_JOBS / rows[RL_JOBS]:.3f} steps/s against "
          f"1 job {1 / rows[1]:.3f} steps/s: {RL_JOBS * rows[1] / rows[RL_JOBS]:.2f}x; with the environment's "
          f"{env_seconds:.2f} s in every round: {RL_JOBS * (rows[1] + env_seconds) / (rows[RL_JOBS] + env_seconds):.2f}x", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smol")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--sizes", default="small,large", help="request sizes of (a): small, large")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-service", action="store_true")
    parser.add_argument("--steps", type=int, default=6, help="RL steps per job in (b)")
    parser.add_argument("--env-seconds", type=float, default=0.25, help="the environment's grading latency in (b)")
    parser.add_argument("--service-modes", default="on,off", help="packing modes of (b): on, off")
    parser.add_argument("--device", default="cpu", help="torch device of the engines and of (b)'s server: cpu or cuda")
    parser.add_argument(
        "--floor", action="store_true", help="also print the compute floor of (b)'s work (engines alone)"
    )
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if not args.skip_engine:
        for key in args.models.split(","):
            engine_bench(MODELS[key], args.rounds, tuple(args.sizes.split(",")), args.device)
    if args.floor:
        floor_bench(args.env_seconds, device=args.device)
    if not args.skip_service:
        service_bench(args.steps, args.env_seconds, tuple(args.service_modes.split(",")), args.device)


if __name__ == "__main__":
    main()
