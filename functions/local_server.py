"""Start `openrl serve` as a child process on a free port and wait until it answers.

Used by the end-to-end tests and the benchmarks, which must talk to a real server over
HTTP exactly as a researcher's script would.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalServer:
    def __init__(self, data_dir: Path, models: list[str], api_keys: str, extra_env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir / "server.log"
        env = dict(os.environ, OPENRL_API_KEYS=api_keys, PYTHONUNBUFFERED="1", **(extra_env or {}))
        command = [sys.executable, "-m", "functions.cli", "serve", "--port", str(self.port), "--data-dir", str(self.data_dir)]
        for model in models:
            command += ["--model", model]
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> "LocalServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"openrl serve exited early:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/api/v1/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"openrl serve did not come up:\n{self.log_tail()}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()

    def log_tail(self) -> str:
        return self.log_path.read_text()[-4000:] if self.log_path.exists() else ""

    def __enter__(self) -> "LocalServer":
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()
