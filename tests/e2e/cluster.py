"""The distributed deployment on one machine: a Kafka-protocol broker (noida-db), a fresh
PostgreSQL database, and gateway, projector, trainer and sampler as separate processes
sharing a data dir (blobs, snapshots). Each part can be killed and restarted."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from sqlalchemy import create_engine, select

from eventing.store import tables
from functions.local_server import REPO, LocalProcess, LocalServer
from tests.eventing.brokers import NoidaBroker

KEY = "tml-cluster-alice"
KEYS = f"alice={KEY}"
MODEL = "openrl/tiny-qwen3"


class Cluster:
    def __init__(
        self,
        root: Path,
        database_url: str,
        snapshot_every: int = 2,
        timeslicer: bool = False,
        extra_env: Optional[dict] = None,
        keys: str = KEYS,
        role_args: Optional[dict[str, list[str]]] = None,
        role_env: Optional[dict[str, dict]] = None,
    ) -> None:
        self.root = root
        self.keys = keys
        self.role_args = role_args or {}  # more CLI flags of a role (`sampler`: `--engine vllm`)
        self.role_env = role_env or {}  # more environment of a role's process only (a log level)
        self.database_url = database_url
        self.broker = NoidaBroker(root / "broker").start()
        self.env = {
            "OPENRL_BUS": "kafka",
            "OPENRL_KAFKA_BOOTSTRAP": self.broker.bootstrap,
            "OPENRL_DATABASE_URL": database_url,
            "OPENRL_SNAPSHOT_EVERY_STEPS": str(snapshot_every),
            "OPENRL_MODELS": MODEL,
            **(extra_env or {}),
        }
        self.data = root / "data"
        self.workers: dict[str, LocalProcess] = {}
        self.gateway: Optional[LocalServer] = None
        self.timeslicer = timeslicer
        if timeslicer:  # the node's daemon, which trainer and sampler processes share
            self.socket = Path(tempfile.mkdtemp(prefix="openrl-ts-")) / "timeslicer.sock"
            self.env["OPENRL_TIMESLICER_SOCKET"] = str(self.socket)

    def start_timeslicer(self) -> LocalProcess:
        process = LocalProcess(self.data, "timeslicer", self.keys, ["--http-port", "0"], self.env)
        self.workers["timeslicer"] = process
        return process.wait_ready()

    def start(self) -> "Cluster":
        if self.timeslicer:
            self.start_timeslicer()
        for role in ("projector", "trainer", "sampler"):
            self.start_role(role)
        self.start_gateway()
        for worker in self.workers.values():
            worker.wait_ready()
        return self

    @contextmanager
    def running(self) -> Iterator["Cluster"]:
        """Started, and stopped at the end whatever happens; a failure prints every part's log."""
        try:
            yield self.start()
        except BaseException:
            print(self.logs())
            raise
        finally:
            self.stop()

    def start_role(self, role: str, extra_args: Optional[list[str]] = None) -> LocalProcess:
        """The role's process (again); `extra_args` in place of its `role_args`."""
        args = ["--base-model", MODEL] if role in ("trainer", "sampler") else []
        args += self.role_args.get(role, []) if extra_args is None else extra_args
        env = {**self.env, **self.role_env.get(role, {})}
        self.workers[role] = LocalProcess(self.data, role, self.keys, args, env)
        return self.workers[role]

    def start_gateway(self, port: Optional[int] = None) -> LocalServer:
        self.gateway = LocalServer(self.data, [MODEL], self.keys, self.env, role="gateway", port=port)
        return self.gateway.wait_ready()

    @property
    def url(self) -> str:
        return self.gateway.url

    def stop(self) -> None:
        for part in [self.gateway, *reversed(list(self.workers.values()))]:
            if part is not None:
                part.stop()
        self.broker.stop()

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """An `openrl` command against this deployment, run to completion."""
        env = dict(os.environ, OPENRL_API_KEYS=self.keys, **self.env)
        command = [sys.executable, "-m", "functions.cli", *args, "--data-dir", str(self.data)]
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)

    def logs(self) -> str:
        parts = [self.gateway, *self.workers.values()]
        return "\n".join(f"--- {p.role}\n{p.log_tail()}" for p in parts if p is not None)

    def query(self, statement):
        engine = create_engine(self.database_url.replace("postgresql://", "postgresql+psycopg://", 1))
        try:
            with engine.connect() as conn:
                return conn.execute(statement).all()
        finally:
            engine.dispose()

    def checkpoint_files(self, tinker_path: str) -> dict:
        rows = self.query(select(tables.checkpoints.c.files).where(tables.checkpoints.c.tinker_path == tinker_path))
        assert rows, f"no checkpoint {tinker_path}"
        return {name: ref["sha256"] for name, ref in rows[0].files.items()}
