"""`openrl timeslicer` (run the node daemon) and `openrl timeslicer status` (show it)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys
from pathlib import Path


def add_parser(commands) -> None:
    parser = commands.add_parser("timeslicer", help="the node-local timeslicer daemon, or its status")
    parser.add_argument("action", nargs="?", choices=("run", "status"), default="run", help="run (default) or status")
    parser.add_argument(
        "--socket", type=Path, default=None, help="its Unix socket (default <data-dir>/timeslicer.sock)"
    )
    parser.add_argument("--data-dir", type=Path, default=None, help="where the default socket lives (default ./.data)")
    parser.add_argument(
        "--accelerator-memory", default=None, help="memory budget per accelerator, e.g. 6GiB (CPU default: none)"
    )
    parser.add_argument(
        "--devices", type=int, default=None, help="CPU only: how many accelerators to model (default 1)"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: the OPENRL_DEVICE setting)")
    parser.add_argument("--policy", choices=("fifo", "lrs"), default=None, help="turn order (default lrs)")
    parser.add_argument("--lease-seconds", type=float, default=None, help="lease lifetime (default 10)")
    parser.add_argument(
        "--affinity-seconds", type=float, default=None, help="wait for a run's next request (default 0.1; 0: off)"
    )
    parser.add_argument("--http-host", default="0.0.0.0", help="address of /metrics, /status, /healthz")
    parser.add_argument(
        "--http-port", type=int, default=None, help="port of /metrics, /status, /healthz (default 9465)"
    )
    parser.add_argument("--json", action="store_true", help="status: print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from functions.timeslicer import setup
    from openrl_core.settings import Settings

    overrides = {
        "data_dir": args.data_dir, "timeslicer_socket": args.socket, "accelerator_memory": args.accelerator_memory,
        "accelerators": args.devices, "timeslicer_policy": args.policy, "lease_seconds": args.lease_seconds,
        "timeslicer_http_port": args.http_port, "device": args.device,
        "timeslicer_affinity_seconds": args.affinity_seconds,
    }  # fmt: skip
    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    path = setup.socket_path(settings)
    if args.action == "status":
        return _status(path, args.json)
    from functions.timeslicer.daemon import Daemon

    daemon = Daemon(setup.service(settings), path, args.http_host, settings.timeslicer_http_port)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, daemon.stop)
        serving = asyncio.create_task(daemon.serve())
        await asyncio.get_running_loop().run_in_executor(None, daemon.ready.wait)
        print(
            f"openrl: timeslicer on {path}, http :{daemon.bound_http_port}, devices {setup.budgets(settings)}",
            flush=True,
        )
        await serving

    asyncio.run(main())
    return 0


def _status(path: Path, as_json: bool) -> int:
    try:
        status = _ask(path, {"op": "status", "id": 1})["status"]
    except OSError as error:
        print(f"openrl timeslicer status: cannot reach {path}: {error}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"node {status['node']}  policy {status['policy']}  lease {status['lease_seconds']} s  "
          f"uptime {status['uptime_seconds']:.0f} s  expired leases {status['lease_expiries']}")  # fmt: skip
    for device in status["devices"]:
        budget = "none" if device["budget_bytes"] is None else _size(device["budget_bytes"])
        holder = device["holder"]
        print(f"\n{device['device']}: budget {budget}, resident {_size(device['resident_bytes'])}, "
              f"duty cycle {device['duty_cycle']:.1%}, switches {device['switches']}")  # fmt: skip
        print(
            f"  holder   {holder['job']} (lease {holder['lease_id']}, {holder['deadline']:.1f} s left)"
            if holder
            else "  holder   -"
        )
        for waiter in device["waiters"]:
            print(f"  waiting  {waiter['job']} ({waiter['waiting_seconds']:.2f} s)")
        print(f"  {'job':<48} {'worker':<28} {'bytes':>10}  state")
        for job in device["residents"]:
            state = "parked" if job["parked"] else ("pinned" if not job["parkable"] else "resident")
            print(f"  {job['job']:<48} {str(job.get('worker')):<28} {_size(job['bytes']):>10}  {state}")
    return 0


def _ask(path: Path, message: dict) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall((json.dumps(message) + "\n").encode())
        return json.loads(sock.makefile("rb").readline())


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
