"""A real `openrl serve` subprocess on a free port, driven by the real tinker SDK."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

API_KEY = "tml-e2e-alice"
OTHER_KEY = "tml-e2e-bob"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, data_dir: Path, models: list[str], extra_env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = data_dir
        self.log_path = data_dir / "server.log"
        data_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OPENRL_API_KEYS=f"alice={API_KEY},bob={OTHER_KEY}", PYTHONUNBUFFERED="1", **(extra_env or {}))
        command = [sys.executable, "-m", "functions.cli", "serve", "--port", str(self.port), "--data-dir", str(data_dir)]
        for model in models:
            command += ["--model", model]
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"openrl serve exited early:\n{self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/api/v1/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"openrl serve did not come up:\n{self.log_path.read_text()[-4000:]}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()

    def log_tail(self) -> str:
        return self.log_path.read_text()[-4000:]


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("openrl-e2e"), ["openrl/tiny-qwen3"])
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def sdk_env(server, monkeypatch):
    monkeypatch.setenv("TINKER_BASE_URL", server.url)
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    return server
