"""Accelerators per node, from the Kubernetes Node objects and each node's timeslicer status.

A node offers devices when it is Ready, schedulable, and allocates `nvidia.com/gpu`. Its
per-device memory comes, in order of trust, from its timeslicer's `/status` (the budget the
daemon really enforces), the label `openrl.ai/accelerator-memory` (e.g. `40GiB`, set by an
operator), or GPU feature discovery's `nvidia.com/gpu.memory` (MiB). Memory held by jobs
the scheduler did not place (the timeslicer's residents that are not ours) is reserved.
A node left out says why, so `openrl scheduler --once` can show it.
"""

from __future__ import annotations

from typing import Mapping, Optional

from functions.scheduler.timeslicer_status import NodeStatus
from openrl_core.errors import InvalidRequest
from openrl_core.placement import Device
from openrl_core.quantity import parse_bytes

ACCELERATOR = "nvidia.com/gpu"
MEMORY_LABEL = "openrl.ai/accelerator-memory"
GFD_MEMORY_LABEL = "nvidia.com/gpu.memory"


def _ready(node: dict) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _label_memory(labels: Mapping[str, str]) -> Optional[int]:
    try:
        if MEMORY_LABEL in labels:
            return parse_bytes(labels[MEMORY_LABEL])
        if GFD_MEMORY_LABEL in labels:
            return parse_bytes(f"{labels[GFD_MEMORY_LABEL]}Mi")
    except InvalidRequest:
        return None
    return None


def devices_from(nodes: list[dict], statuses: Mapping[str, NodeStatus], is_ours) -> tuple[list[Device], dict[str, str]]:
    """(devices, node -> why it offers none). `is_ours(job)` tells the scheduler's own residents."""
    devices: list[Device] = []
    skipped: dict[str, str] = {}
    for node in nodes:
        name = node["metadata"]["name"]
        labels = node["metadata"].get("labels") or {}
        count = int(str((node.get("status") or {}).get("allocatable", {}).get(ACCELERATOR, "0")) or 0)
        if (node.get("spec") or {}).get("unschedulable"):
            skipped[name] = "cordoned (unschedulable)"
        elif not _ready(node):
            skipped[name] = "not Ready"
        elif count <= 0:
            skipped[name] = f"no {ACCELERATOR} allocatable"
        elif name in statuses and all(d.budget_bytes is not None for d in statuses[name].devices):
            for device in statuses[name].devices:
                if device.index < count:
                    foreign = sum(r.bytes for r in device.residents if not r.parked and not is_ours(r.job))
                    devices.append(Device(name, device.index, device.budget_bytes, foreign))
        else:
            memory = _label_memory(labels)
            if memory is None:
                skipped[name] = f"no timeslicer status and no {MEMORY_LABEL} or {GFD_MEMORY_LABEL} label"
            else:
                devices.extend(Device(name, index, memory) for index in range(count))
    return devices, skipped
