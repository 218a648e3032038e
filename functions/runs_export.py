"""`openrl runs export RUN... --tensorboard DIR --jsonl FILE`: runs' step metrics in standard formats.

It reads each run's `GET /api/openrl/v1/runs/{run}/metrics` (one JSON object per step:
functions/gateway/routes/openrl_runs.py) and writes
- TensorBoard event files, one directory per run (`DIR/<run id with ':' as '_'>`: a run id's
  colons are not portable in file names), written with TensorBoard's own `EventFileWriter`:
  per step one scalar per number the row holds (`loss`, `optim/grad_norm`, `learning_rate`,
  `tokens`, `forward_backward`, `step_seconds`, `queue_wait_seconds`, `sampled_tokens`,
  `sampling_seconds`, `sampling_tokens_per_s`, and `reported/<name>` for each number the
  client reported, such as `reported/reward`), at the step's number and with the step's
  completion time as its wall time; a null is left out, not written as 0;
- JSONL: the rows as the server sent them, `run_id` added, appended to FILE (several runs
  can share one file), so a file written twice holds the rows twice.
`tensorboard --logdir DIR` then shows every run's curves side by side.
"""

from __future__ import annotations

import json
import math
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Optional

SCALARS = ("loss", "optim/grad_norm", "learning_rate", "tokens", "forward_backward", "step_seconds",
           "queue_wait_seconds", "sampled_tokens", "sampling_seconds", "sampling_tokens_per_s")  # fmt: skip


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numbers as TensorBoard tags (nulls and non-finite numbers left out)."""
    out = {key: row[key] for key in SCALARS if _number(row.get(key))}
    out.update({f"reported/{k}": v for k, v in (row.get("reported") or {}).items() if _number(v)})
    return {k: float(v) for k, v in out.items()}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def wall_time(row: dict[str, Any]) -> float:
    moment = row.get("completed_at")
    return datetime.fromisoformat(moment).timestamp() if moment else time.time()


def run_dir(logdir: Path, run_id: str) -> Path:
    return Path(logdir) / run_id.replace(":", "_").replace("/", "_")


def write_tensorboard(logdir: Path, run_id: str, rows: Iterable[dict[str, Any]]) -> Path:
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    target = run_dir(logdir, run_id)
    target.mkdir(parents=True, exist_ok=True)
    writer = EventFileWriter(str(target))
    try:
        for row in rows:
            values = [summary_pb2.Summary.Value(tag=tag, simple_value=v) for tag, v in scalars(row).items()]
            if values and row.get("step") is not None:
                summary = summary_pb2.Summary(value=values)
                writer.add_event(event_pb2.Event(wall_time=wall_time(row), step=int(row["step"]), summary=summary))
    finally:
        writer.close()
    return target


def write_jsonl(path: Path, run_id: str, rows: Iterable[dict[str, Any]]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        for row in rows:
            handle.write(json.dumps({"run_id": run_id, **row}) + "\n")


def export(client, args, out, check) -> int:
    """The `runs export` command over an httpx client of the OpenRL API (cli_runs.run gives it)."""
    tensorboard: Optional[Path] = args.tensorboard
    jsonl: Optional[Path] = args.jsonl
    if tensorboard is None and jsonl is None:
        from functions.api_error import ApiError

        raise ApiError(400, "nothing to write: pass --tensorboard DIR and/or --jsonl FILE")
    fetched = {}
    for run_id in args.run_ids:  # every run first: an unknown one writes nothing at all
        response = check(client.get(f"/runs/{run_id}/metrics"))
        fetched[run_id] = [json.loads(line) for line in response.text.splitlines() if line.strip()]
    answer: dict[str, Any] = {"schema": "openrl.export.v1", "runs": []}
    for run_id, rows in fetched.items():
        entry: dict[str, Any] = {"run_id": run_id, "steps": len(rows)}
        if tensorboard is not None:
            entry["tensorboard"] = str(write_tensorboard(tensorboard, run_id, rows))
        if jsonl is not None:
            write_jsonl(jsonl, run_id, rows)
            entry["jsonl"] = str(jsonl)
        answer["runs"].append(entry)
    lines = [
        f"{e['run_id']}: {e['steps']} steps"
        + "".join(f", {kind} {e[kind]}" for kind in ("tensorboard", "jsonl") if kind in e)
        for e in answer["runs"]
    ]
    print(json.dumps(answer) if args.json else "\n".join(lines), file=out)
    return 0
