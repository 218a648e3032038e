"""From process settings to a timeslicer: which devices with which budgets, where the socket is.

- `device_name("cuda")` -> "cuda:0": the name a worker's torch device has on the daemon.
- `budgets(settings)`: on CUDA one entry per visible GPU, budget `accelerator_memory` or
  90% of the GPU's memory; on CPU `accelerators` entries with `accelerator_memory` or no
  limit (so that parking is testable on CPU, the budget is whatever the operator says).
- `socket_path(settings)`: `timeslicer_socket`, or <data_dir>/timeslicer.sock; a path too
  long for AF_UNIX (108 bytes) is replaced by a short one under /tmp, derived from it, so
  every process that computes it from the same settings finds the same socket.
- `connect(settings, worker, on_park)`: a client to the configured daemon, or to a private
  in-process slicer when no socket is configured and none is given.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Optional

from functions.timeslicer.client import ParkHandler, TimeslicerClient, unix_transport
from functions.timeslicer.local import LocalSlicer
from functions.timeslicer.service import SlicerService
from openrl_core.settings import Settings
from openrl_core.timeslice import Policy

UNIX_PATH_MAX = 100  # sun_path is 108 bytes with the NUL; keep a margin


def device_name(device: str) -> str:
    return device if ":" in device else f"{device}:0"


def budgets(settings: Settings) -> dict[str, Optional[int]]:
    if settings.device.startswith("cuda"):
        import torch

        out = {}
        for index in range(torch.cuda.device_count()):
            total = torch.cuda.get_device_properties(index).total_memory
            out[f"cuda:{index}"] = settings.accelerator_memory or int(total * 0.9)
        if out:
            return out
    return {f"cpu:{index}": settings.accelerator_memory for index in range(settings.accelerators)}


def socket_path(settings: Settings) -> Path:
    path = (
        Path(settings.timeslicer_socket)
        if settings.timeslicer_socket
        else settings.data_dir.resolve() / "timeslicer.sock"
    )
    if len(str(path)) <= UNIX_PATH_MAX:
        return path
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"openrl-timeslicer-{digest}.sock"


def service(settings: Settings) -> SlicerService:
    return SlicerService(
        budgets(settings),
        policy=Policy(settings.timeslicer_policy),
        lease_seconds=settings.lease_seconds,
        aging_seconds=settings.timeslicer_aging_seconds,
        affinity_seconds=settings.timeslicer_affinity_seconds,
        quantum_seconds=settings.timeslicer_quantum_seconds,
    )


def connect(
    settings: Settings, worker: str, on_park: Optional[ParkHandler] = None, socket: Optional[Path] = None
) -> TimeslicerClient:
    """A client for one worker: to `socket` (or the configured daemon), else a private slicer."""
    path = socket or (socket_path(settings) if settings.timeslicer_socket else None)
    if path is not None:
        return TimeslicerClient(unix_transport(str(path)), worker, on_park)
    return TimeslicerClient(LocalSlicer(service(settings)).connect, worker, on_park)


def private(worker: str = "worker", on_park: Optional[ParkHandler] = None) -> TimeslicerClient:
    """An in-process slicer with no budget, for a worker built without settings (tests)."""
    return TimeslicerClient(LocalSlicer(SlicerService({"cpu:0": None})).connect, worker, on_park)
