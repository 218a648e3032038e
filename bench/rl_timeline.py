"""Where the time of concurrent RL jobs goes: a per-request timeline of `bench/packing.py`'s (b).

Runs the same RL loop (`packing.rl_job`) against `openrl serve` at DEBUG level, then reads the
server's event store and log back:

- per request (sample, forward_backward, optim_step, save_weights_for_sampler of every job):
  when the gateway took it (the requested event's time), when its worker began (a trainer
  completion's `details.started`; a sampler batch's start from its debug line) and when it
  finished (the completed event's time);
- the trainer's packed passes and the sampler's batches (who was in each, how long each ran);
- a summary: per verb the median wait (gateway -> worker) and work (worker start -> done), and
  how much of the phase the trainer and the sampler were busy (union of their work spans).

    .venv/bin/python bench/rl_timeline.py [--jobs 4] [--steps 4] [--env-seconds 0.25] [--env KEY=VALUE ...]

Not a benchmark of its own (no ratios): a diagnostic for the 4-job row of bench/packing.py.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from packing import SERVICE_MODEL, rl_run

VERBS = {"sample": "S", "forward_backward": "F", "optim_step": "O", "save_weights_for_sampler": "W"}
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) DEBUG (\S+): (.*)$")


def _ts(text: str) -> float:
    return (
        datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()
        if "+" not in text
        else datetime.fromisoformat(text).timestamp()
    )


def events(data_dir: Path) -> list[dict]:
    from sqlalchemy import create_engine, select

    from eventing.store import tables

    engine = create_engine(f"sqlite:///{data_dir / 'events.db'}")
    with engine.connect() as conn:
        rows = conn.execute(
            select(tables.events.c.type, tables.events.c.time, tables.events.c.data).order_by(tables.events.c.position)
        ).all()
    engine.dispose()
    out = []
    for type_, when, data in rows:
        try:
            payload = json.loads(data) if data else {}
        except ValueError:
            payload = {}
        out.append(
            {
                "type": type_,
                "time": when.replace(tzinfo=timezone.utc).timestamp() if when.tzinfo is None else when.timestamp(),
                "data": payload,
            }
        )
    return out


def requests(evts: list[dict]) -> dict[str, dict]:
    """request_id -> {verb, model, requested, started, done}."""
    table: dict[str, dict] = {}
    for e in evts:
        parts = e["type"].split(".")
        if len(parts) < 5 or parts[-3] not in VERBS:
            continue
        verb, phase, data = parts[-3], parts[-2], e["data"]
        rid = data.get("request_id")
        if rid is None:
            continue
        row = table.setdefault(rid, {"verb": verb})
        if phase == "requested":
            row["requested"] = e["time"]
            row["model"] = data.get("model_id") or data.get("run_id")
        elif phase in ("completed", "failed"):
            row["done"] = e["time"]
            started = (data.get("details") or {}).get("started")
            if started:
                row["started"] = datetime.fromisoformat(started).timestamp()
    return table


def log_lines(path: Path, since: float) -> list[tuple[float, str, str]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = LOG_LINE.match(line)
        if m:
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=timezone.utc).timestamp()
            if t >= since:
                out.append((t, m.group(2), m.group(3)))
    return out


def union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def report(data_dir: Path, log_path: Path, since: float, until: float) -> None:
    table = {k: v for k, v in requests(events(data_dir)).items() if v.get("requested", 0) >= since and "done" in v}
    models = sorted({r["model"] for r in table.values() if r.get("model")})
    label = {m: f"j{i}" for i, m in enumerate(models)}
    lines = log_lines(log_path, since)
    batches = []  # sampler batches: (start, end, text)
    for t, name, text in lines:
        m = re.search(r"sampler: batch of .* ran ([\d.]+) s", text)
        if m:
            batches.append((t - float(m.group(1)), t, text))
    print("\n== timeline (s from phase start; verbs S sample, F forward_backward, O optim_step, W save_for_sampler) ==")
    print("job verb   gateway  start    done     wait   work")
    for r in sorted(table.values(), key=lambda r: r["requested"]):
        started = r.get("started")
        if started is None and r["verb"] == "sample":
            # the sampler batch that finished when this request did began it
            hits = [b for b in batches if abs(b[1] - r["done"]) < 0.05]
            started = hits[0][0] if hits else None
        r["started_est"] = started
        s = f"{started - since:7.3f}" if started else "   -   "
        w = f"{started - r['requested']:6.3f}" if started else "  -   "
        k = f"{r['done'] - started:6.3f}" if started else "  -   "
        print(
            f"{label.get(r.get('model'), '?'):>3} {VERBS[r['verb']]:>4} {r['requested'] - since:8.3f} {s} {r['done'] - since:8.3f} {w} {k}"
        )
    print("\n== worker lines ==")
    for t, name, text in lines:
        if "packed" in text or "sampler: batch" in text or "turn" in text:
            for m, lab in label.items():
                text = text.replace(m, lab)
            print(f"{t - since:8.3f} {text[:200]}")
    print("\n== summary ==")
    wall = until - since
    for verb in VERBS:
        rs = [r for r in table.values() if r["verb"] == verb]
        waits = [r["started_est"] - r["requested"] for r in rs if r.get("started_est")]
        works = [r["done"] - r["started_est"] for r in rs if r.get("started_est")]
        lat = [r["done"] - r["requested"] for r in rs]
        if rs:
            print(f"{verb:<26} n={len(rs):<3} latency p50 {statistics.median(lat):.3f}  wait p50 "
                  f"{statistics.median(waits) if waits else float('nan'):.3f}  work p50 {statistics.median(works) if works else float('nan'):.3f}")  # fmt: skip
    trainer = union([(r["started"], r["done"]) for r in table.values() if r.get("started")])
    sampler = union([(a, b) for a, b, _ in batches])
    print(f"phase {wall:.2f} s: trainer busy {trainer:.2f} s ({trainer / wall:.0%}), sampler busy {sampler:.2f} s "
          f"({sampler / wall:.0%}), either {union([(r['started'], r['done']) for r in table.values() if r.get('started')] + [(a, b) for a, b, _ in batches]):.2f} s")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--env-seconds", type=float, default=0.25)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server")
    args = parser.parse_args()
    from functions.local_server import LocalServer

    extra = {"OPENRL_LOG_LEVEL": "DEBUG", "OPENRL_SNAPSHOT_EVERY_STEPS": "0"}
    extra.update(dict(kv.split("=", 1) for kv in args.env))
    data_dir = Path(tempfile.mkdtemp(prefix="openrl-rl-timeline-"))
    server = LocalServer(
        data_dir, [SERVICE_MODEL], "alice=tml-bench-alice,bob=tml-bench-bob", extra_env=extra
    ).wait_ready()
    try:
        rl_run(server.url, 1, 2, args.env_seconds)  # warm-up
        since = time.time()
        rate = rl_run(server.url, args.jobs, args.steps, args.env_seconds)
        until = time.time()
    finally:
        server.stop()
    print(f"{args.jobs} jobs x {args.steps} steps: {rate:.3f} steps/s; data in {data_dir}")
    report(data_dir, server.log_path, since, until)


if __name__ == "__main__":
    main()
