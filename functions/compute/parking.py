"""Parking: a job's device tensors moved to host memory and back, bitwise.

A `Slot` is one place a tensor lives (a parameter's data, a parameter's gradient, an entry
of an optimizer-state dict); `park(slots)` copies each to host memory (pinned on CUDA, so
the copy back runs at full PCIe speed and asynchronously) and frees the device copy;
`restore` puts them back. The tensor objects the model holds (its `Parameter`s) stay the
same objects, so modules, PEFT and optimizer bookkeeping never notice. On CPU the "device"
is host memory: parking still copies and frees (that is the operation being measured and
tested), and restoring hands the host copy back without a second copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch


@dataclass
class Slot:
    """Where a tensor lives: read it with `get`, replace it with `set` (None frees it)."""

    name: str
    get: Callable[[], Optional[torch.Tensor]]
    set: Callable[[Optional[torch.Tensor]], None]


@dataclass
class Parked:
    host: dict[str, Optional[torch.Tensor]]
    device: torch.device
    nbytes: int
    seconds: float


def param_slots(prefix: str, params: dict[str, torch.nn.Parameter], with_grads: bool = True) -> list[Slot]:
    slots = []
    for key, param in params.items():
        slots.append(Slot(f"{prefix}{key}", lambda p=param: p.data, lambda t, p=param: setattr(p, "data", t)))
        if with_grads:
            slots.append(Slot(f"{prefix}{key}.grad", lambda p=param: p.grad, lambda t, p=param: setattr(p, "grad", t)))
    return slots


def dict_slots(prefix: str, tensors: dict[str, torch.Tensor]) -> list[Slot]:
    def setter(key):
        def assign(t):
            tensors[key] = t

        return assign

    return [Slot(f"{prefix}{key}", lambda k=key: tensors[k], setter(key)) for key in list(tensors)]


def park(slots: Iterable[Slot]) -> Parked:
    started = time.perf_counter()
    host: dict[str, Optional[torch.Tensor]] = {}
    device, nbytes = torch.device("cpu"), 0
    pending = []
    for slot in slots:
        tensor = slot.get()
        if tensor is None:
            host[slot.name] = None
            continue
        device = tensor.device
        if tensor.device.type == "cuda":
            copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            copy.copy_(tensor, non_blocking=True)
        else:
            copy = tensor.detach().clone()
        host[slot.name] = copy
        nbytes += tensor.numel() * tensor.element_size()
        pending.append(slot)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # every copy is on the host before the device copies go
    for slot in pending:
        slot.set(torch.empty(0, dtype=host[slot.name].dtype, device=device))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Parked(host, device, nbytes, time.perf_counter() - started)


def restore(slots: Iterable[Slot], parked: Parked) -> float:
    """Put every parked tensor back on its device; returns the seconds it took."""
    started = time.perf_counter()
    for slot in slots:
        copy = parked.host.get(slot.name)
        if copy is None:
            if slot.name in parked.host:
                slot.set(None)
            continue
        slot.set(copy if parked.device.type == "cpu" else copy.to(parked.device, non_blocking=True))
    if parked.device.type == "cuda":
        torch.cuda.synchronize(parked.device)
    return time.perf_counter() - started


def park_once(holder, slots: list[Slot]) -> tuple[float, int]:
    """Park `slots` into `holder.parked` unless it is parked already; (seconds, bytes) moved."""
    if holder.parked is not None:
        return 0.0, 0
    holder.parked = park(slots)
    return holder.parked.seconds, holder.parked.nbytes


def restore_once(holder, slots: list[Slot]) -> tuple[float, int]:
    """Restore `holder.parked` into `slots` if it is parked; (seconds, bytes) moved."""
    if holder.parked is None:
        return 0.0, 0
    parked, holder.parked = holder.parked, None
    return restore(slots, parked), parked.nbytes


def nbytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
