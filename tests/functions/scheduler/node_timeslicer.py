"""A real node timeslicer daemon (`functions.timeslicer.daemon`) for the scheduler's tests:
served in a thread, its HTTP status on a loopback address of the test's choosing (one per
simulated node), its Unix socket in a short temporary directory, and real worker clients
that register jobs, hold leases and wait, so `/status` reports what a node would."""

from __future__ import annotations

import tempfile
from pathlib import Path

from functions.timeslicer.client import TimeslicerClient, unix_transport
from functions.timeslicer.daemon import Daemon
from functions.timeslicer.service import SlicerService
from openrl_core.timeslice import Policy


class NodeTimeslicer:
    def __init__(self, host: str, node: str, budgets: dict, policy: str = "lrs") -> None:
        self.socket = Path(tempfile.mkdtemp(prefix="ts-")) / "ts.sock"
        self.service = SlicerService(budgets, Policy(policy), node=node)
        self.daemon = Daemon(self.service, self.socket, http_host=host, http_port=0)
        self.host = host
        self.clients: list[TimeslicerClient] = []

    def __enter__(self) -> "NodeTimeslicer":
        self.daemon.start_in_thread()
        self.port = self.daemon.bound_http_port
        self.url = f"http://{self.host}:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        for client in self.clients:
            client.close()
        self.daemon.stop()

    def worker(self, name: str) -> TimeslicerClient:
        client = TimeslicerClient(unix_transport(str(self.socket)), name)
        self.clients.append(client)
        return client
