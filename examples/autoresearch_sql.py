"""Autoresearch: a sweep of the Text-to-SQL RL recipe as parallel runs against one OpenRL server.

Every point of the grid (learning rate x LoRA rank x group size; by default {3e-4, 1e-3} x
{8, 32} x {4, 8}, eight runs) is its own process running `text_to_sql_rl.py` with its own
LoRA training run, at most `--parallel` of them (default 4) at once; all of them talk to the
same server (TINKER_BASE_URL, TINKER_API_KEY), which multiplexes their adapters on one copy
of the base model. That is the point of an API boundary: the researcher's loop is a client, so many
experiments are many clients, not many GPUs' worth of model copies. Each run writes its curve
(`<out>/<run>.jsonl`); this script then picks the best run by held-out execution accuracy
after training (ties: the higher mean training reward over the last steps) and writes
`<out>/report.md` (a table), `<out>/report.png` (every run's reward curve, labelled with its
learning rate, rank and group size) and `<out>/report.json` (the same numbers, with when
each run started and ended).
`make autoresearch` starts `openrl serve` and runs it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from curves import read_jsonl  # noqa: E402

RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "text_to_sql_rl.py")


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def run_name(lr: float, rank: int, group: int) -> str:
    return f"lr{lr:g}_r{rank}_g{group}"


def launch(name: str, lr: float, rank: int, group: int, args) -> subprocess.Popen:
    command = [
        sys.executable,
        RECIPE,
        "--learning-rate",
        str(lr),
        "--rank",
        str(rank),
        "--group-size",
        str(group),
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--eval-size",
        str(args.eval_size),
        "--max-tokens",
        str(args.max_tokens),
        "--base-model",
        args.base_model,
        "--seed",
        str(args.seed),
        "--out",
        os.path.join(args.out, name),
        "--label",
        name,
    ]
    log = open(os.path.join(args.out, name + ".log"), "w")
    # Each run's own progress lines go to its log; this process prints a line per finished run.
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def legend_label(r: dict) -> str:
    return f"lr {r['lr']:g}, rank {r['rank']}, group {r['group']} ({r['after']:.0%})"


def tail_reward(rows: list[dict], last: int = 3) -> float:
    values = [r["reward"] for r in rows[-last:]]
    return sum(values) / len(values) if values else 0.0


def write_report(results: list[dict], args, wall: float) -> str:
    best = max((r for r in results if r["ok"]), key=lambda r: (r["after"], r["tail_reward"]), default=None)
    lines = [
        f"# Text-to-SQL RL sweep ({len(results)} runs, {args.parallel} at a time, one server)",
        "",
        f"Base model `{args.base_model}`, {args.steps} steps of {args.batch_size} questions each; held-out execution "
        f"accuracy (greedy) on {args.eval_size or 'all'} questions. Wall time of the whole sweep: {wall:.0f} s.",
        "",
        "| run | learning rate | LoRA rank | group size | held-out before | held-out after | joins after | reward, last 3 steps | run wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (-r["after"], -r["tail_reward"])):
        mark = " **best**" if best is not None and r["name"] == best["name"] else ""
        if r["ok"]:
            joins = "–" if r["after_join"] is None else f"{r['after_join']:.1%}"
            lines.append(
                f"| {r['name']}{mark} | {r['lr']:g} | {r['rank']} | {r['group']} | {r['before']:.1%} | {r['after']:.1%} "
                f"| {joins} | {r['tail_reward']:.3f} | {r['wall_s']:.0f} |"
            )
        else:
            lines.append(
                f"| {r['name']} | {r['lr']:g} | {r['rank']} | {r['group']} | failed (see {r['name']}.log) | | | | |"
            )
    lines += ["", "![reward curves](report.png)", ""]
    if best is not None:
        lines.append(f"Best: `{best['name']}` (held-out {best['before']:.1%} -> {best['after']:.1%}).")
    path = os.path.join(args.out, "report.md")
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")

    plt.figure(figsize=(7, 4))
    for r in results:
        if r["rows"]:
            plt.plot([x["step"] for x in r["rows"]], [x["reward"] for x in r["rows"]], label=legend_label(r))
    plt.xlabel("step")
    plt.ylabel("mean training reward")
    plt.title("Text-to-SQL RL sweep (held-out accuracy after, in brackets)")
    plt.grid(alpha=0.3)
    plt.legend(fontsize=7)
    plt.tight_layout()
    plt.savefig(os.path.join(args.out, "report.png"), dpi=120)
    plt.close()
    with open(os.path.join(args.out, "report.json"), "w") as handle:
        json.dump(
            {
                "parallel": args.parallel,
                "wall_s": round(wall, 1),
                "best": best["name"] if best else None,
                "runs": [{k: v for k, v in r.items() if k != "rows"} for r in results],
            },
            handle,
            indent=1,
        )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learning-rates", type=floats, default=floats("3e-4,1e-3"))
    parser.add_argument("--ranks", type=ints, default=ints("8,32"))
    parser.add_argument("--group-sizes", type=ints, default=ints("4,8"))
    parser.add_argument("--parallel", type=int, default=4, help="runs in flight at once (the rest wait their turn)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--eval-size", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--base-model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/autoresearch")
    args = parser.parse_args()
    if args.parallel < 1:
        parser.error(f"--parallel must be 1 or more, got {args.parallel}")
    os.makedirs(args.out, exist_ok=True)
    started = time.monotonic()

    grid = list(itertools.product(args.learning_rates, args.ranks, args.group_sizes))
    pending = [(run_name(*point), *point) for point in grid]
    running: dict[str, tuple] = {}
    results: list[dict] = []
    print(
        f"{len(grid)} runs, {args.parallel} at a time, against {os.environ.get('TINKER_BASE_URL', 'the default server')}",
        flush=True,
    )
    while pending or running:
        while pending and len(running) < args.parallel:
            name, lr, rank, group = pending.pop(0)
            running[name] = (launch(name, lr, rank, group, args), lr, rank, group, time.monotonic())
            print(f"started {name} ({len(running)} running, {len(pending)} waiting)", flush=True)
        time.sleep(1)
        for name, (process, lr, rank, group, begun) in list(running.items()):
            if process.poll() is None:
                continue
            del running[name]
            stem = os.path.join(args.out, name)
            ok = process.returncode == 0 and os.path.exists(stem + ".summary.json")
            summary = json.load(open(stem + ".summary.json")) if ok else {}
            rows = read_jsonl(stem + ".jsonl") if os.path.exists(stem + ".jsonl") else []
            results.append(
                {
                    "name": name,
                    "lr": lr,
                    "rank": rank,
                    "group": group,
                    "ok": ok,
                    "rows": rows,
                    "before": summary.get("before", 0.0),
                    "after": summary.get("after", 0.0),
                    "after_join": summary.get("after_join"),
                    "tail_reward": tail_reward(rows),
                    "wall_s": time.monotonic() - begun,
                    "started_s": round(begun - started, 2),
                    "ended_s": round(time.monotonic() - started, 2),
                }
            )
            status = (
                f"held-out {summary['before']:.1%} -> {summary['after']:.1%}"
                if ok
                else f"FAILED (exit {process.returncode}, see {stem}.log)"
            )
            elapsed = time.monotonic() - started
            done = len(results)
            eta = elapsed / done * (len(grid) - done)
            print(f"run {done}/{len(grid)} {name}: {status}  elapsed {elapsed:.0f}s  eta {eta:.0f}s", flush=True)

    report = write_report(results, args, time.monotonic() - started)
    print(f"report: {report} and {os.path.join(args.out, 'report.png')}")
    if not any(r["ok"] for r in results):
        sys.exit("every run failed")


if __name__ == "__main__":
    main()
