"""Start `openrl` processes as children and wait until they are ready.

Used by the end-to-end tests and the benchmarks, which must talk to a real server over
HTTP exactly as a researcher's script would: `LocalServer` runs `openrl serve` (or
`openrl gateway`) and is ready when `/api/v1/healthz` answers; `LocalProcess` runs any
other role (`trainer`, `sampler`, `projector`) and is ready when it prints its banner.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalProcess:
    def __init__(
        self,
        data_dir: Path,
        role: str,
        api_keys: str,
        args: Optional[list[str]] = None,
        extra_env: Optional[dict[str, str]] = None,
        log_name: Optional[str] = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.role = role
        self.log_path = self.data_dir / (log_name or f"{role}.log")
        self._env = dict(os.environ, OPENRL_API_KEYS=api_keys, PYTHONUNBUFFERED="1", **(extra_env or {}))
        self._command = [sys.executable, "-m", "functions.cli", role, "--data-dir", str(self.data_dir), *(args or [])]
        self.process: Optional[subprocess.Popen] = None
        self.start()

    def start(self) -> None:
        self._log = open(self.log_path, "a")
        self._log_start = self.log_path.stat().st_size
        self.process = subprocess.Popen(
            self._command, cwd=REPO, env=self._env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout: float = 300) -> "LocalProcess":
        self._wait(lambda: "openrl: " in self._new_output(), timeout)
        return self

    def _wait(self, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"openrl {self.role} exited early:\n{self.log_tail()}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"openrl {self.role} was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def _new_output(self) -> str:
        with open(self.log_path) as handle:
            handle.seek(self._log_start)
            return handle.read()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs, nothing is flushed or committed."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        self._log.close()

    def log_tail(self) -> str:
        return self.log_path.read_text()[-4000:] if self.log_path.exists() else ""

    def __enter__(self):
        try:
            return self.wait_ready()
        except BaseException:  # never became ready: no process is left behind
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalServer(LocalProcess):
    """`openrl serve` (all roles) or `openrl gateway`, on a free port."""

    def __init__(
        self,
        data_dir: Path,
        models: list[str],
        api_keys: str,
        extra_env: Optional[dict[str, str]] = None,
        role: str = "serve",
        port: Optional[int] = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["--port", str(self.port)]
        for model in models:
            args += ["--model", model]
        super().__init__(data_dir, role, api_keys, args, extra_env, log_name="server.log" if role == "serve" else None)

    def wait_ready(self, timeout: float = 300) -> "LocalServer":
        def healthy() -> bool:
            try:
                return httpx.get(self.url + "/api/v1/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        self._wait(healthy, timeout)
        return self
