"""`openrl timeslicer` as an operator runs it: the daemon as a process, `status` as a table and as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from functions.local_server import REPO
from functions.timeslicer.client import TimeslicerClient, unix_transport


def openrl(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "functions.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_the_daemon_serves_workers_and_status_shows_them():
    socket = Path(tempfile.mkdtemp(prefix="ts-")) / "ts.sock"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "functions.cli", "timeslicer", "--socket", str(socket), "--accelerator-memory", "1GiB",
         "--devices", "2", "--policy", "fifo", "--http-port", "0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )  # fmt: skip
    try:
        banner = ""
        while not banner.startswith("openrl: "):  # log lines come first
            banner = daemon.stdout.readline()
            assert banner, "the daemon exited"
        assert banner.startswith("openrl: timeslicer on") and "cpu:1" in banner, banner
        worker = TimeslicerClient(unix_transport(str(socket)), "trainer-7")
        worker.register("trainer-7/model/run-1", 300 * 2**20, "cpu:0")
        worker.register("trainer-7/base/tiny", 100 * 2**20, "cpu:0", parkable=False, resident=True)
        with worker.turn("trainer-7/model/run-1"):
            time.sleep(0.05)
        table = openrl("timeslicer", "status", "--socket", str(socket))
        assert table.returncode == 0, table.stderr
        assert "policy fifo" in table.stdout and "cpu:0: budget 1.0 GiB, resident 400.0 MiB" in table.stdout
        lines = {line.split()[0]: line for line in table.stdout.splitlines() if line.strip().startswith("trainer-7/")}
        assert "resident" in lines["trainer-7/model/run-1"] and "300.0 MiB" in lines["trainer-7/model/run-1"]
        assert "pinned" in lines["trainer-7/base/tiny"] and "trainer-7" in lines["trainer-7/base/tiny"]
        status = json.loads(openrl("timeslicer", "status", "--json", "--socket", str(socket)).stdout)
        first, second = status["devices"]
        assert first["budget_bytes"] == 2**30 and second["device"] == "cpu:1" and first["switches"] == 1
        assert first["busy_seconds"] >= 0.05 and 0 < first["duty_cycle"] < 1
        worker.close()
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
    assert not socket.exists(), "the daemon removes its socket on the way out"
    gone = openrl("timeslicer", "status", "--socket", str(socket))
    assert gone.returncode == 2 and "cannot reach" in gone.stderr
