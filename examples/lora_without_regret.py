"""LoRA Without Regret, scaled to one CPU: six RL runs at once against one OpenRL server.

The design of the "LoRA Without Regret" RL experiment (Schulman et al., Thinking Machines,
2025: full fine-tuning, LoRA rank 32 and LoRA rank 1, two seeds each, GSM8K), on a model and
task a CPU can run: SmolLM2-135M-Instruct on generated grade-school word problems with a
numeric answer (`word_problems.py`; no download). All six runs are clients of one server, in
threads of this one script, each with its own training run and sampler:

- the two full fine-tuning runs (`user_metadata={"openrl.full_finetune": "true"}`) each keep
  their own float32 weights, gradients and AdamW moments; `make recipe-lora-without-regret`
  gives the server's timeslicer a memory budget (OPENRL_ACCELERATOR_MEMORY) that holds one of
  them with the shared base weights but not both, so they take turns on the accelerator,
  parking to host memory and back;
- the four LoRA runs (rank 32 ×2, rank 1 ×2) share the one base model's trainer and sampler:
  their forward_backward requests run packed in shared passes.

Each step of each run: draw `--problems` problems from the run's seeded stream (the same
problems for every arm of a seed), sample `--group-size` completions each (temperature 1),
reward 1 when the last number of the reply is the answer, advantages = reward − the group's
mean (groups whose rewards all agree are dropped: they teach nothing), `forward_backward` with
`importance_sampling` on the sampler's logprobs, `optim_step`, publish the weights for the
next step's sampler. The step's reward goes back to the server through the SDK's telemetry
(`training_client.get_telemetry().log("openrl.step_metrics", ...)`, when telemetry is on),
keyed by the run's optim_step number, where `openrl runs export` puts it beside the server's
own step metrics (a step that trained nothing makes no optim_step and reports nothing).

Learning rates, the paper's rule: LoRA's is 10x full fine-tuning's, the same for every rank
(Tinker's LoRA scales its update by alpha/rank with alpha fixed at 32, which is what makes
the best learning rate nearly rank-independent). Full fine-tuning's is 5e-5, LoRA's 5e-4,
chosen by a short sweep on seed 0 (10 steps, `docs/figures/lora_without_regret.md`): the
starting point, tinker-cookbook's `hyperparam_utils.get_lr` for the Llama family at hidden size
576 (1.32e-4 full, 1.32e-3 LoRA), is its supervised rule, and at 1.32e-4 a full run's held-out
accuracy fell (25% to 0-15%); full at 2e-5 and 5e-5 and LoRA at 2e-4, 5e-4 and 1.3e-3 all
raised the reward, so the largest full rate tried that learned was kept and LoRA's is 10x it.

Output under `--out` (default out/lora_without_regret): one JSONL curve per run, `report.md`
(the table: mean reward over the last `--tail` steps per arm, seed spread = max − min of the
seeds' tail means, held-out greedy accuracy before and after), `report.png` (each arm's mean
reward over its seeds per step, with a band from the lowest to the highest seed),
`report.json`, the accelerator duty cycle (share of the wall time some lease held the device,
from the server's timeslicer timeline, `/api/openrl/v1/timeline`) and the wall time against
the six runs one after another: estimated from each arm measured alone afterwards for
`--solo-steps` steps (setup, mean step time, evaluation), unless `--sequential measure`
runs all six alone for real.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Optional

import matplotlib
import tinker
from curves import CurveLog
from tinker import types
from word_problems import prompt_text, score, split

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
FULL_LR = 5e-5  # chosen by the sweep in the docstring; LoRA gets LORA_FACTOR x this
LORA_FACTOR = 10.0
ARMS = [("full", None), ("lora-r32", 32), ("lora-r1", 1)]
STOP = ["\n", "<|im_end|>"]
TRAIN_PIECE = 16  # sequences per forward_backward call: bounds the trainer's activation memory


@dataclass(frozen=True)
class Spec:
    arm: str
    rank: Optional[int]  # None: full fine-tuning
    seed: int

    @property
    def name(self) -> str:
        return f"{self.arm}-s{self.seed}"


def datums(prompt: list[int], sequences, rewards: list[float]) -> list[types.Datum]:
    """Group-relative advantages on every sampled token (reward − group mean); prompt positions get 0."""
    mean = sum(rewards) / len(rewards)
    out = []
    for seq, r in zip(sequences, rewards):
        tokens, pad = prompt + list(seq.tokens), [0.0] * (len(prompt) - 1)
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": pad + list(seq.logprobs),
                    "advantages": pad + [r - mean] * len(seq.tokens),
                },
            )
        )
    return out


def accuracy(sampler, tokenizer, problems, max_tokens: int) -> float:
    greedy = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=STOP)
    futures = [
        sampler.sample(
            types.ModelInput.from_ints(tokenizer.encode(prompt_text(q), add_special_tokens=False)), 1, greedy
        )
        for q, _, _ in problems
    ]
    hits = [
        score(tokenizer.decode(f.result().sequences[0].tokens, skip_special_tokens=True), a)
        for f, (_, _, a) in zip(futures, problems)
    ]
    return sum(hits) / len(hits)


def run(spec: Spec, steps: int, args, held_out, stream, out_dir: str, label: str = "") -> dict:
    """One RL run from creation to its held-out accuracy; returns its numbers and timings."""
    started = time.monotonic()
    service = tinker.ServiceClient()
    metadata = {"openrl.full_finetune": "true"} if spec.rank is None else None
    training = service.create_lora_training_client(
        base_model=args.base_model, rank=spec.rank or 32, seed=spec.seed, user_metadata=metadata
    ).result()
    tokenizer = training.get_tokenizer()
    telemetry = training.get_telemetry()  # None when TINKER_TELEMETRY=0
    lr = args.full_lr * (1.0 if spec.rank is None else args.lora_lr_factor)
    adam = types.AdamParams(learning_rate=lr)
    problems = stream(random.Random(spec.seed))
    sampler = training.save_weights_and_get_sampling_client().result()
    setup_s = time.monotonic() - started
    before_started = time.monotonic()
    before = accuracy(sampler, tokenizer, held_out, args.max_tokens)
    before_s = time.monotonic() - before_started
    log = CurveLog(os.path.join(out_dir, label or spec.name), steps, spec.name, label=label or spec.name)
    step_seconds, trained = [], 0
    for step in range(1, steps + 1):
        t0 = time.monotonic()
        batch = [next(problems) for _ in range(args.problems)]
        prompts = [tokenizer.encode(prompt_text(q), add_special_tokens=False) for q, _, _ in batch]
        futures = [
            sampler.sample(types.ModelInput.from_ints(p), args.group_size,
                           types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=STOP,
                                                seed=spec.seed * 1_000_003 + step * 101 + i))
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        results = [f.result() for f in futures]
        sample_s = time.monotonic() - t0
        sampled = sum(len(s.tokens) for r in results for s in r.sequences)
        data, rewards = [], []
        for prompt, (_, _, answer), result in zip(prompts, batch, results):
            group = [score(tokenizer.decode(s.tokens, skip_special_tokens=True), answer) for s in result.sequences]
            rewards += group
            if len(set(group)) > 1:
                data += datums(prompt, result.sequences, group)
        loss = grad_norm = None
        if data:
            # Submitted together, as an async RL loop does; the pieces' gradients add up until optim_step.
            pieces = [training.forward_backward(data[i : i + TRAIN_PIECE], "importance_sampling")
                      for i in range(0, len(data), TRAIN_PIECE)]  # fmt: skip
            optim = training.optim_step(adam)
            next_sampler = training.save_weights_and_get_sampling_client()
            loss = sum(piece.result().metrics["loss:sum"] for piece in pieces)
            grad_norm = optim.result().metrics.get("optim/grad_norm")
            sampler = next_sampler.result()
        reward = sum(rewards) / len(rewards)
        step_seconds.append(time.monotonic() - t0)
        sampling_tps = sampled / sample_s if sample_s > 0 else None
        log.record(step, reward=reward, trained_rollouts=len(data), loss=loss, grad_norm=grad_norm, lr=lr,
                   sampling_tokens_per_s=sampling_tps, step_s=round(step_seconds[-1], 3))  # fmt: skip
        if data:
            trained += 1
            if telemetry is not None:
                # Keyed by the run's optim_step number, so the server puts the reward on the row of
                # the step it trained; a step with no group to learn from makes no optim_step, and
                # its reward stays in this script's JSONL only.
                telemetry.log("openrl.step_metrics", {"run_id": training.model_id, "step": trained, "reward": reward,
                                                      "client_step": step, "sampling_tokens_per_s": sampling_tps,
                                                      "trained_rollouts": len(data)})  # fmt: skip
    eval_started = time.monotonic()
    after = accuracy(sampler, tokenizer, held_out, args.max_tokens)
    eval_s = before_s + time.monotonic() - eval_started  # both evaluations
    close(service)
    return {"name": spec.name, "arm": spec.arm, "rank": spec.rank, "seed": spec.seed, "run_id": training.model_id,
            "lr": lr, "rows": log.rows, "before": before, "after": after, "setup_s": setup_s, "step_seconds": step_seconds,
            "eval_s": eval_s, "wall_s": time.monotonic() - started}  # fmt: skip


def close(service: tinker.ServiceClient, timeout: float = 30.0) -> None:
    """Finish the session, waiting at most `timeout`. With telemetry on, under Python 3.11, the
    SDK's close can wait forever: it cancels its periodic telemetry flush just after waking it,
    and 3.11's `asyncio.wait_for` can swallow a cancellation that races its inner wait (fixed
    in 3.12), so the task it then awaits never ends. The session is finished on the server
    before that wait (its `finish` request comes first), so nothing is lost by moving on."""
    try:
        service.close("success").result(timeout=timeout)
    except TimeoutError:
        print(
            f"the tinker SDK's close did not return within {timeout:.0f} s (its telemetry task); going on", flush=True
        )


def timeline(since: float) -> dict:
    """The server's timeslicer timeline (OpenRL's own API; the tinker SDK has no call for it)."""
    url = os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000").rstrip("/")
    request = urllib.request.Request(
        f"{url}/api/openrl/v1/timeline?since={since}", headers={"X-API-Key": os.environ.get("TINKER_API_KEY", "")}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())
    except (OSError, ValueError) as error:
        return {"available": False, "reason": str(error)}


def duty_cycle(start: float, end: float) -> dict:
    """Share of [start, end] (unix seconds) that some lease held each device, and the parks in it."""
    answer = timeline(start)
    if not answer.get("available"):
        return {"available": False, "reason": answer.get("reason")}
    devices = {}
    for device, entries in answer["devices"].items():
        busy = sum(max(0.0, min(e["end"] or end, end) - max(e["start"], start))
                   for e in entries if e.get("kind") == "lease")  # fmt: skip
        parks = sum(1 for e in entries if e.get("kind") == "park" and start <= e["start"] <= end)
        devices[device] = {"duty_cycle": busy / max(end - start, 1e-9), "busy_s": busy, "parks": parks}
    return {"available": True, "devices": devices}


def in_threads(specs: list[Spec], steps: int, args, held_out, stream, out_dir: str) -> list[dict]:
    results: dict[str, dict] = {}
    errors: list[BaseException] = []

    def go(spec: Spec) -> None:
        try:
            results[spec.name] = run(spec, steps, args, held_out, stream, out_dir)
        except BaseException as error:  # reported after every thread ended
            errors.append(error)

    threads = [threading.Thread(target=go, args=(s,), name=s.name) for s in specs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [results[s.name] for s in specs]


def tail_mean(rows: list[dict], tail: int) -> float:
    values = [r["reward"] for r in rows[-tail:]]
    return sum(values) / len(values)


def arm_table(runs: list[dict], tail: int) -> list[dict]:
    table = []
    for arm, rank in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        tails = [tail_mean(r["rows"], tail) for r in mine]
        table.append({"arm": arm, "rank": rank, "lr": mine[0]["lr"], "seeds": [r["seed"] for r in mine],
                      "tail_reward": sum(tails) / len(tails), "tail_rewards": tails, "spread": max(tails) - min(tails),
                      "before": sum(r["before"] for r in mine) / len(mine), "after": sum(r["after"] for r in mine) / len(mine),
                      "after_per_seed": [r["after"] for r in mine]})  # fmt: skip
    return table


def plot(runs: list[dict], path: str, title: str) -> None:
    plt.figure(figsize=(7, 4))
    for (arm, _), color in zip(ARMS, ["tab:blue", "tab:orange", "tab:green"]):
        curves = [[row["reward"] for row in r["rows"]] for r in runs if r["arm"] == arm]
        steps = list(range(1, len(curves[0]) + 1))
        by_step = list(zip(*curves))
        plt.plot(steps, [sum(v) / len(v) for v in by_step], color=color, label=f"{arm} (mean of {len(curves)} seeds)")
        plt.fill_between(steps, [min(v) for v in by_step], [max(v) for v in by_step], color=color, alpha=0.2)
    plt.xlabel("step")
    plt.ylabel("mean reward of the step's rollouts")
    plt.title(title, fontsize=9)
    plt.grid(alpha=0.3)
    plt.legend(fontsize=8)
    plt.tight_layout()
    plt.savefig(path, dpi=120)
    plt.close()


def estimate_sequential(solo: dict[str, dict], steps: int, seeds: int) -> float:
    """Six runs one after another, from each arm measured alone: setup + steps x step time + the
    two evaluations. The first step is left out of the step time where there are more (it warms caches)."""
    total = 0.0
    for result in solo.values():
        measured = result["step_seconds"][1:] or result["step_seconds"]
        total += seeds * (result["setup_s"] + steps * sum(measured) / len(measured) + result["eval_s"])
    return total


def write_report(out: str, args, table, runs, concurrent: dict, sequential: dict) -> str:
    c, s = concurrent, sequential
    lines = [
        f"# LoRA Without Regret on one OpenRL server ({len(runs)} runs at once)",
        "",
        f"`{args.base_model}`, {args.steps} steps of {args.problems} word problems × {args.group_size} samples per "
        f"run, importance_sampling with group-relative advantages; held-out greedy accuracy on {args.eval_problems} "
        f"problems; learning rate {args.full_lr:.3g} full, {args.full_lr * args.lora_lr_factor:.3g} LoRA.",
        "",
        f"| arm | learning rate | mean reward, last {args.tail} steps | seed spread (max − min) | held-out before | held-out after |",
        "|---|---|---|---|---|---|",
    ]
    for row in table:
        lines.append(f"| {row['arm']} | {row['lr']:.3g} | {row['tail_reward']:.3f} | {row['spread']:.3f} | "
                     f"{row['before']:.1%} | {row['after']:.1%} ({', '.join(f'{a:.1%}' for a in row['after_per_seed'])}) |")  # fmt: skip
    lines += ["", "![reward curves](report.png)", ""]
    lines.append(f"Wall time of the six runs at once: **{c['wall_s']:.0f} s**; one after another: "
                 f"**{s['wall_s']:.0f} s** ({s['how']}).")  # fmt: skip
    for phase, numbers in (("at once", c), ("alone", s)):
        duty = numbers.get("duty")
        if duty and duty.get("available"):
            for device, d in duty["devices"].items():
                lines.append(f"Accelerator {device} duty cycle {phase}: **{d['duty_cycle']:.1%}** "
                             f"({d['busy_s']:.0f} s held of {numbers['window_s']:.0f} s, {d['parks']} parks).")  # fmt: skip
        elif duty:
            lines.append(f"Duty cycle {phase}: not available ({duty.get('reason')}).")
    path = os.path.join(out, "report.md")
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", default=BASE_MODEL)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--problems", type=int, default=8, help="problems per step")
    parser.add_argument("--group-size", type=int, default=8, help="samples per problem")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--eval-problems", type=int, default=40)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--full-lr", type=float, default=FULL_LR)
    parser.add_argument("--lora-lr-factor", type=float, default=LORA_FACTOR)
    parser.add_argument("--tail", type=int, default=4, help="the table's reward is the mean over the last N steps")
    parser.add_argument("--sequential", choices=["estimate", "measure", "skip"], default="estimate")
    parser.add_argument("--solo-steps", type=int, default=2, help="steps of each arm measured alone (estimate)")
    parser.add_argument("--out", default="out/lora_without_regret")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    held_out, stream = split(1234, args.eval_problems)
    specs = [Spec(arm, rank, seed) for arm, rank in ARMS for seed in seeds]

    service = tinker.ServiceClient()  # holds the script's session open while the runs have their own
    start_unix, started = time.time(), time.monotonic()
    runs = in_threads(specs, args.steps, args, held_out, stream, args.out)
    wall = time.monotonic() - started
    concurrent = {"wall_s": wall, "window_s": wall, "duty": duty_cycle(start_unix, start_unix + wall)}

    sequential: dict = {"wall_s": float("nan"), "how": "not measured"}
    if args.sequential != "skip":
        solo_dir = os.path.join(args.out, "alone")
        solo_start, solo_started = time.time(), time.monotonic()
        if args.sequential == "measure":
            solo = {s.name: run(s, args.steps, args, held_out, stream, solo_dir) for s in specs}
            solo_wall = time.monotonic() - solo_started
            sequential = {"wall_s": solo_wall, "how": "measured: the six runs alone, one after another"}
        else:
            solo = {arm: run(Spec(arm, rank, seeds[0]), args.solo_steps, args, held_out, stream, solo_dir)
                    for arm, rank in ARMS}  # fmt: skip
            solo_wall = time.monotonic() - solo_started
            sequential = {"wall_s": estimate_sequential(solo, args.steps, len(seeds)),
                          "how": f"estimated from each arm run alone for {args.solo_steps} steps: setup + "
                                 f"{args.steps} x its mean step time + evaluation, x {len(seeds)} seeds"}  # fmt: skip
        sequential["window_s"] = solo_wall
        sequential["duty"] = duty_cycle(solo_start, solo_start + solo_wall)
        sequential["solo"] = {
            k: {x: v[x] for x in ("setup_s", "step_seconds", "eval_s", "wall_s")} for k, v in solo.items()
        }

    table = arm_table(runs, args.tail)
    title = (f"{args.base_model.split('/')[-1]}, generated word problems: {len(runs)} runs at once on one server\n"
             f"(line: mean of the seeds, band: lowest to highest seed)")  # fmt: skip
    plot(runs, os.path.join(args.out, "report.png"), title)
    print(write_report(args.out, args, table, runs, concurrent, sequential), flush=True)
    with open(os.path.join(args.out, "report.json"), "w") as handle:
        json.dump({"args": vars(args), "table": table, "concurrent": concurrent,
                   "sequential": sequential, "runs": [{k: v for k, v in r.items() if k != "rows"} for r in runs]},
                  handle, indent=1)  # fmt: skip
    close(service)


if __name__ == "__main__":
    main()
