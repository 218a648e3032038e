"""`openrl runs|checkpoints|sessions`: the OpenRL API (`/api/openrl/v1`) from a shell or an agent.

Every command talks to a running server over HTTP: `--url` (else `$TINKER_BASE_URL`, else
http://127.0.0.1:8000) with `--api-key` (else `$TINKER_API_KEY`), a tenant's key or the
operator's. By default it prints a table; with `--json` it prints the server's JSON as is
(one object with a `schema` field, numbers as numbers; `runs show --metrics --json` prints
one object per optim_step per line). An error exits 1 and, with `--json`, prints
`{"schema": "openrl.error.v1", "status": ..., "detail": ...}`; without, the detail on stderr.
`runs export RUN... --tensorboard DIR --jsonl FILE` writes runs' step metrics as TensorBoard
event files and JSONL (functions/runs_export.py). `runs fork RUN --at-step N` waits for the fork to be rebuilt (`--wait`) and exits 1 unless it
is ready (its `openrl.fork.v1` answer, with `status`, is printed with `--json` either way).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import httpx

from functions.api_error import ApiError

COMMANDS = ("runs", "checkpoints", "sessions")
API = "/api/openrl/v1"
DEFAULT_URL = "http://127.0.0.1:8000"
FORK_POLL = 50.0  # seconds one fork request waits on the server, under the client's 60 s timeout


def add_commands(commands) -> None:
    def client_options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--url", default=None, help="the server (default $TINKER_BASE_URL, else http://127.0.0.1:8000)"
        )
        parser.add_argument(
            "--api-key", default=None, help="a tenant's or the operator's key (default $TINKER_API_KEY)"
        )
        parser.add_argument(
            "--json", action="store_true", help="print the server's JSON (schema-versioned) instead of a table"
        )

    runs = commands.add_parser("runs", help="training runs on a server: list, show (--metrics), cancel, fork")
    verbs = runs.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="runs with status, base model, LoRA or full, steps, last activity")
    listing.add_argument("--status", default=None, help="only runs with this status (active, finished, cancelled, ...)")
    listing.add_argument("--limit", type=int, default=100)
    show = verbs.add_parser("show", help="one run; --metrics: its per-step metrics")
    show.add_argument("run_id")
    show.add_argument("--metrics", action="store_true", help="one line per optim_step (JSONL with --json)")
    cancel = verbs.add_parser("cancel", help="cancel a run: its pending requests fail, its trainer state is dropped")
    cancel.add_argument("run_id")
    cancel.add_argument("--reason", default=None, help="recorded in the cancellation event and the failed futures")
    fork = verbs.add_parser(
        "fork", help="a new run whose weights and optimizer are RUN's right after its N-th optim_step"
    )
    fork.add_argument("run_id")
    fork.add_argument("--at-step", type=int, required=True, help="N: 0 (as created) up to the run's completed steps")
    fork.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the rebuild (default 600)")
    export = verbs.add_parser(
        "export", help="runs' per-step metrics as TensorBoard event files and/or JSONL (functions/runs_export.py)"
    )
    export.add_argument("run_ids", nargs="+", metavar="RUN")
    export.add_argument(
        "--tensorboard", type=Path, default=None, metavar="DIR", help="one event-file directory per run"
    )
    export.add_argument("--jsonl", type=Path, default=None, metavar="FILE", help="one line per step, appended")
    for parser in (listing, show, cancel, fork, export):
        client_options(parser)

    checkpoints = commands.add_parser("checkpoints", help="checkpoints on a server: list, download, delete")
    verbs = checkpoints.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="live checkpoints, newest first")
    listing.add_argument("--run", dest="run_id", default=None, help="only this run's")
    download = verbs.add_parser("download", help="write a checkpoint's files as one tar archive")
    download.add_argument("path", help="tinker://<run>/<kind>/<name>")
    download.add_argument(
        "-o", "--output", type=Path, default=None, help="archive file (default ./<run>-<kind>-<name>.tar)"
    )
    delete = verbs.add_parser("delete", help="delete a checkpoint (and its files nothing else uses)")
    delete.add_argument("path", help="tinker://<run>/<kind>/<name>")
    for parser in (listing, download, delete):
        client_options(parser)

    sessions = commands.add_parser("sessions", help="sessions on a server: list")
    verbs = sessions.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="sessions, newest first, with their runs and sampling sessions")
    listing.add_argument("--limit", type=int, default=100)
    client_options(listing)


def run(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout
    url = (args.url or os.environ.get("TINKER_BASE_URL") or DEFAULT_URL).rstrip("/")
    key = args.api_key or os.environ.get("TINKER_API_KEY")
    if not key:
        return _fail(args, out, 401, "no API key: pass --api-key or set TINKER_API_KEY")
    with httpx.Client(base_url=url + API, headers={"X-API-Key": key}, timeout=60) as client:
        try:
            return HANDLERS[(args.command, args.verb)](client, args, out)
        except ApiError as exc:
            return _fail(args, out, exc.status, exc.detail)
        except httpx.HTTPError as exc:
            return _fail(args, out, 0, f"cannot reach {url}: {exc}")


def _fail(args, out, status: int, detail: str) -> int:
    if getattr(args, "json", False):
        print(json.dumps({"schema": "openrl.error.v1", "status": status, "detail": detail}), file=out)
    else:
        print(f"openrl {args.command} {args.verb}: {detail}", file=sys.stderr)
    return 1


def _check(response: httpx.Response) -> httpx.Response:
    if response.status_code >= 400:
        try:
            detail = str(response.json().get("detail"))
        except ValueError:
            detail = response.text or response.reason_phrase
        raise ApiError(response.status_code, detail)
    return response


def _get(client: httpx.Client, path: str, **params) -> dict:
    return _check(client.get(path, params={k: v for k, v in params.items() if v is not None})).json()


def _emit(args, out, answer: dict, table: str) -> int:
    print(json.dumps(answer) if args.json else table, file=out)
    return 0


# -- tables ---------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A plain aligned table: `columns` are (heading, key); None prints as '-'."""
    cells = [[_cell(row.get(key)) for _, key in columns] for row in rows]
    headings = [heading for heading, _ in columns]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headings)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headings, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines) if rows else lines[0] + "\n(none)"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict) and set(value) == {"run", "step"}:  # a fork's origin
        return f"{value['run']} at step {value['step']}"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, str) and len(value) >= 19 and value[10:11] == "T":
        return value[:19].replace("T", " ")  # an ISO time, to the second
    return str(value)


RUN_COLUMNS = [("RUN", "run_id"), ("STATUS", "status"), ("BASE MODEL", "base_model"), ("TRAINING", "training"),
               ("STEPS", "steps"), ("LAST ACTIVITY", "last_activity")]  # fmt: skip
STEP_COLUMNS = [("STEP", "step"), ("LOSS", "loss"), ("GRAD NORM", "optim/grad_norm"), ("LR", "learning_rate"),
                ("TOKENS", "tokens"), ("STEP S", "step_seconds"), ("QUEUE S", "queue_wait_seconds")]  # fmt: skip
CHECKPOINT_COLUMNS = [("PATH", "tinker_path"), ("KIND", "kind"), ("BYTES", "size_bytes"), ("CREATED", "created_at"),
                      ("EXPIRES", "expires_at")]  # fmt: skip


# -- commands -------------------------------------------------------------------------------


def _runs_list(client, args, out) -> int:
    answer = _get(client, "/runs", status=args.status, limit=args.limit)
    columns = RUN_COLUMNS + ([("TENANT", "tenant")] if len({r["tenant"] for r in answer["runs"]}) > 1 else [])
    return _emit(args, out, answer, table(answer["runs"], columns))


def _runs_show(client, args, out) -> int:
    if args.metrics:
        response = _check(client.get(f"/runs/{args.run_id}/metrics"))
        rows = [json.loads(line) for line in response.text.splitlines() if line.strip()]
        if args.json:
            for row in rows:
                print(json.dumps(row), file=out)
            return 0
        print(table(rows, STEP_COLUMNS), file=out)
        return 0
    answer = _get(client, f"/runs/{args.run_id}")
    run_, step = answer["run"], answer["last_step"]
    lines = [f"{key:<24}{_cell(run_[key])}" for key in run_]
    lines.append(f"{'pending_requests':<24}{answer['pending_requests']}")
    if step is not None:
        lines.append(
            f"{'last_step':<24}step {step['step']}, loss {_cell(step['loss'])}, grad norm {_cell(step['optim/grad_norm'])}"
        )
    lines += ["", table(answer["checkpoints"], CHECKPOINT_COLUMNS)]
    if answer["sampling_sessions"]:
        lines += [
            "",
            table(answer["sampling_sessions"], [("SAMPLING SESSION", "sampling_session_id"), ("CLOSED", "closed_at")]),
        ]
    return _emit(args, out, answer, "\n".join(lines))


def _runs_cancel(client, args, out) -> int:
    body = {"reason": args.reason} if args.reason else {}
    answer = _check(client.post(f"/runs/{args.run_id}/cancel", json=body)).json()
    text = f"cancelled {answer['run_id']}: {answer['cancelled_requests']} pending request(s) failed"
    if answer["closed_sampling_sessions"]:
        text += f", {len(answer['closed_sampling_sessions'])} sampling session(s) closed"
    return _emit(args, out, answer, text)


def _runs_fork(client, args, out) -> int:
    """Waits in long-polls of at most FORK_POLL seconds: the same request again (same
    idempotency key) waits on the same fork, never starting a second one."""
    deadline = time.monotonic() + max(args.wait, 0.0)
    headers = {"X-Idempotency-Key": uuid.uuid4().hex}
    while True:
        wait = min(FORK_POLL, max(deadline - time.monotonic(), 0.0))
        body = {"step": args.at_step, "wait_seconds": round(wait, 3)}
        answer = _check(client.post(f"/runs/{args.run_id}/fork", json=body, headers=headers)).json()
        if answer["status"] != "creating" or time.monotonic() >= deadline:
            break
    origin = answer["forked_from"]
    if answer["status"] == "ready":
        text = (f"forked {origin['run']} at step {origin['step']} as {answer['run_id']}\n"
                f"state (weights and optimizer): {answer['tinker_path']}\n"
                f"load it with create_training_client_from_state_with_optimizer({answer['tinker_path']!r})")  # fmt: skip
        return _emit(args, out, answer, text)
    if answer["status"] == "creating":
        detail = f"fork {answer['run_id']} is still being rebuilt after {args.wait:.0f} s; see openrl runs show {answer['run_id']}"
    else:
        detail = (
            f"fork {answer['run_id']} of {origin['run']} at step {origin['step']} {answer['status']}: {answer['error']}"
        )
    if args.json:
        print(json.dumps(answer), file=out)
    else:
        print(f"openrl runs fork: {detail}", file=sys.stderr)
    return 1


def _checkpoints_list(client, args, out) -> int:
    answer = _get(client, "/checkpoints", run_id=args.run_id)
    return _emit(args, out, answer, table(answer["checkpoints"], CHECKPOINT_COLUMNS))


def _checkpoints_download(client, args, out) -> int:
    target: Optional[Path] = args.output
    with client.stream("GET", "/checkpoints/archive", params={"path": args.path}) as response:
        if response.status_code >= 400:
            response.read()
            _check(response)
        if target is None:
            disposition = response.headers.get("content-disposition", "")
            target = Path(
                disposition.split('filename="', 1)[-1].rstrip('"') if 'filename="' in disposition else "checkpoint.tar"
            )
        partial = target.with_name(target.name + ".part")
        size = 0
        with open(partial, "wb") as handle:
            for chunk in response.iter_bytes():
                handle.write(chunk)
                size += len(chunk)
        partial.replace(target)  # never a half-written archive under the final name
    answer = {"schema": "openrl.download.v1", "tinker_path": args.path, "file": str(target), "size_bytes": size}
    return _emit(args, out, answer, f"wrote {target} ({size} bytes)")


def _checkpoints_delete(client, args, out) -> int:
    answer = _check(client.delete("/checkpoints", params={"path": args.path})).json()
    return _emit(args, out, answer, f"deleted {answer['tinker_path']}")


def _sessions_list(client, args, out) -> int:
    answer = _get(client, "/sessions", limit=args.limit)
    columns = [("SESSION", "session_id"), ("STATUS", "status"), ("RUNS", "training_runs"), ("SAMPLERS", "sampling_sessions"),
               ("CREATED", "created_at"), ("LAST HEARTBEAT", "last_heartbeat_at")]  # fmt: skip
    return _emit(args, out, answer, table(answer["sessions"], columns))


def _runs_export(client, args, out) -> int:
    from functions.runs_export import export

    return export(client, args, out, _check)


HANDLERS = {
    ("runs", "list"): _runs_list,
    ("runs", "show"): _runs_show,
    ("runs", "cancel"): _runs_cancel,
    ("runs", "fork"): _runs_fork,
    ("runs", "export"): _runs_export,
    ("checkpoints", "list"): _checkpoints_list,
    ("checkpoints", "download"): _checkpoints_download,
    ("checkpoints", "delete"): _checkpoints_delete,
    ("sessions", "list"): _sessions_list,
}
