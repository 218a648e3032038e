"""Placement: which accelerator each worker job runs on. Pure: no I/O, no clock, no randomness.

An accelerator (`Device`) lives on a node and has a memory budget: the bytes the node's
timeslicer lets its holders keep resident. Some of it may already be taken by jobs this
policy does not place (`reserved_bytes`, the timeslicer's residents that belong to nobody
we know). A `Job` (a trainer or sampler worker) needs `memory_bytes` resident on one device.
Jobs that share a device time-slice it (the timeslicer grants turns), so several fit on one
device exactly while the sum of their memory stays within its budget. An `exclusive` job
(e.g. a full fine-tuning run that wants the whole device) shares with nobody.

Two policies, both deterministic (inputs are sorted first, so their order never matters) and
both never over a budget:

- `binpack` fills the fewest devices: jobs go in decreasing order of memory; each goes to the
  already used device where it fits tightest (best fit), and only when none can take it is
  another device opened, the one with the least free memory that still fits it (so the big
  devices stay free for big jobs).
- `spread` gives each job a device of its own while devices last: the device with the fewest
  jobs, then the most free memory.

Placing jobs on devices is bin packing with bins of different sizes: a greedy order can fail
to place a job that the other policy places. Binpack's promise is "never more devices than
spread for the same jobs", so when its greedy pass places fewer jobs than spread does, it
packs spread's own assignment instead (moving jobs onto devices spread already uses, never
opening one), which places the same jobs on no more devices. Tests check both properties on
generated inventories.

Jobs already running (`pinned`) keep their device while it still exists and holds them:
moving a worker means restarting it, so placement changes only what must change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Mapping, Optional

from openrl_core.errors import InvalidRequest

Policy = Literal["binpack", "spread"]
POLICIES: tuple[Policy, ...] = ("binpack", "spread")


@dataclass(frozen=True)
class Device:
    node: str
    index: int
    budget_bytes: int
    reserved_bytes: int = 0

    @property
    def id(self) -> str:
        return f"{self.node}/{self.index}"


@dataclass(frozen=True)
class Job:
    name: str
    memory_bytes: int
    exclusive: bool = False


@dataclass(frozen=True)
class Placement:
    assignments: Mapping[str, str] = field(default_factory=dict)  # job name -> device id
    unplaced: Mapping[str, str] = field(default_factory=dict)  # job name -> why it fits nowhere

    def devices_used(self) -> int:
        return len(set(self.assignments.values()))

    def jobs_on(self, device_id: str) -> list[str]:
        return sorted(job for job, device in self.assignments.items() if device == device_id)


@dataclass
class _Load:
    """A device while jobs are being placed on it."""

    device: Device
    jobs: list[Job] = field(default_factory=list)

    @property
    def free(self) -> int:
        return self.device.budget_bytes - self.device.reserved_bytes - sum(job.memory_bytes for job in self.jobs)

    def takes(self, job: Job) -> bool:
        if job.memory_bytes > self.free:
            return False
        # An exclusive job shares with nobody, and nobody joins one.
        return not self.jobs or not (job.exclusive or any(other.exclusive for other in self.jobs))


def place(
    jobs: Iterable[Job], devices: Iterable[Device], policy: Policy, pinned: Optional[Mapping[str, str]] = None
) -> Placement:
    """Assign every job it can to one device; the rest are `unplaced`, each with the reason."""
    if policy not in POLICIES:
        raise InvalidRequest(f"unknown placement policy {policy!r}; choose one of {', '.join(POLICIES)}")
    ordered_jobs = _check_jobs(jobs)
    ordered_devices = _check_devices(devices)
    loads = {device.id: _Load(device) for device in ordered_devices}
    assignments: dict[str, str] = {}
    # Pinned jobs first, largest first, so a device that shrank keeps the ones it still holds.
    for job in ordered_jobs:
        where = (pinned or {}).get(job.name)
        if where in loads and loads[where].takes(job):
            loads[where].jobs.append(job)
            assignments[job.name] = where
    free_jobs = [job for job in ordered_jobs if job.name not in assignments]
    if policy == "spread":
        return _spread(free_jobs, loads, assignments)
    packed = _binpack(free_jobs, _copy(loads), dict(assignments))
    spread = _spread(free_jobs, _copy(loads), dict(assignments))
    if len(packed.assignments) >= len(spread.assignments):
        return packed
    return _compact(spread, ordered_jobs, loads, set(assignments))


def _check_jobs(jobs: Iterable[Job]) -> list[Job]:
    ordered = sorted(jobs, key=lambda job: (-job.memory_bytes, job.name))
    names = [job.name for job in ordered]
    if len(set(names)) != len(names):
        raise InvalidRequest(f"job names must be unique: {sorted({n for n in names if names.count(n) > 1})}")
    bad = [job.name for job in ordered if job.memory_bytes <= 0]
    if bad:
        raise InvalidRequest(f"jobs need a positive memory_bytes: {bad}")
    return ordered


def _check_devices(devices: Iterable[Device]) -> list[Device]:
    ordered = sorted(devices, key=lambda device: (device.node, device.index))
    ids = [device.id for device in ordered]
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"device ids must be unique: {sorted({i for i in ids if ids.count(i) > 1})}")
    bad = [device.id for device in ordered if device.budget_bytes < 0 or device.reserved_bytes < 0]
    if bad:
        raise InvalidRequest(f"device budgets and reservations must not be negative: {bad}")
    return ordered


def _copy(loads: dict[str, _Load]) -> dict[str, _Load]:
    return {key: _Load(load.device, list(load.jobs)) for key, load in loads.items()}


def _why_not(job: Job, loads: dict[str, _Load]) -> str:
    if not loads:
        return "no accelerators in the inventory"
    most = max(load.free for load in loads.values())
    alone = " on an accelerator of its own (exclusive)" if job.exclusive else ""
    return f"needs {job.memory_bytes} bytes{alone}; the most any accelerator has free is {most}"


def _binpack(jobs: list[Job], loads: dict[str, _Load], assignments: dict[str, str]) -> Placement:
    unplaced: dict[str, str] = {}
    for job in jobs:
        used = [load for load in loads.values() if load.jobs and load.takes(job)]
        fresh = [load for load in loads.values() if not load.jobs and load.takes(job)]
        # Tightest fit among used devices; else open the smallest empty device that fits.
        candidates = used or fresh
        if not candidates:
            unplaced[job.name] = _why_not(job, loads)
            continue
        best = min(candidates, key=lambda load: (load.free - job.memory_bytes, load.device.node, load.device.index))
        best.jobs.append(job)
        assignments[job.name] = best.device.id
    return Placement(assignments, unplaced)


def _spread(jobs: list[Job], loads: dict[str, _Load], assignments: dict[str, str]) -> Placement:
    unplaced: dict[str, str] = {}
    for job in jobs:
        candidates = [load for load in loads.values() if load.takes(job)]
        if not candidates:
            unplaced[job.name] = _why_not(job, loads)
            continue
        best = min(candidates, key=lambda load: (len(load.jobs), -load.free, load.device.node, load.device.index))
        best.jobs.append(job)
        assignments[job.name] = best.device.id
    return Placement(assignments, unplaced)


def _compact(spread: Placement, jobs: list[Job], loads: dict[str, _Load], pinned: set[str]) -> Placement:
    """Spread's assignment with whole devices emptied where their jobs fit on the other used ones.

    Every step moves jobs only onto devices that take them, so the result is always valid,
    places exactly spread's jobs, and uses no more devices than spread did.
    """
    by_name = {job.name: job for job in jobs}
    target = {key: _Load(load.device) for key, load in loads.items()}
    for name, device in spread.assignments.items():
        target[device].jobs.append(by_name[name])
    # Try the lightest devices first: they are the easiest to empty.
    for key in sorted((k for k, load in target.items() if load.jobs), key=lambda k: (-target[k].free, k)):
        movable = target[key].jobs
        if not movable or any(job.name in pinned for job in movable):
            continue
        trial = {k: _Load(load.device, list(load.jobs)) for k, load in target.items() if k != key and load.jobs}
        for job in movable:
            fits = [load for load in trial.values() if load.takes(job)]
            if not fits:
                break
            min(fits, key=lambda load: (load.free - job.memory_bytes, load.device.node, load.device.index)).jobs.append(
                job
            )
        else:
            for k, load in trial.items():
                target[k] = load
            target[key] = _Load(target[key].device)
    assignments = {job.name: key for key, load in target.items() for job in load.jobs}
    return Placement(assignments, dict(spread.unplaced))
