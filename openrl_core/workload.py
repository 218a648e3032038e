"""Which worker processes a cluster needs now, from what its runs are doing. Pure: the clock is an argument.

The scheduler reads the event store into `Activity` rows: one per training run (LoRA or full
fine-tuning) and one per sampling session, each with its session's state, the time of its
last request and its unfinished futures. `wanted_workers` turns them into `WorkerSpec`s:

- a base model's LoRA trainer serves every LoRA run on it; its sampler every sampling session;
- a full fine-tuning run has a trainer of its own (`--kind full --model-id RUN`);
- `floor` base models keep their trainer and sampler whatever the demand.

The lifecycle rules, each a test (tests/openrl_core/test_workload.py):

- a run or sampling session with unfinished futures always wants its worker (a worker that
  disappeared is replaced, never abandoned with requests in flight);
- an unfinished session that sent a request within `idle` keeps its worker: a run between
  steps is only briefly idle, and releasing a GPU worker costs minutes of cold start;
- past `idle` with nothing pending, the worker is released;
- when a session finishes, its runs release their workers at once (a finished session sends
  no more requests).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Iterable, Literal, Optional

ActivityKind = Literal["lora", "full", "sampling"]
Role = Literal["trainer", "sampler"]


@dataclass(frozen=True)
class Activity:
    tenant: str
    key: str  # the run's model_id, or the sampling_session_id
    kind: ActivityKind
    base_model: str
    session_finished: bool
    last_request: datetime
    pending: int = 0
    oldest_pending: Optional[datetime] = None


@dataclass(frozen=True)
class WorkerSpec:
    role: Role
    base_model: str
    model_id: Optional[str] = None  # set for a full fine-tuning run's own trainer

    @property
    def kind(self) -> str:
        """The trainer's `--kind`: full runs have their own trainers, so the shared one is LoRA only."""
        if self.role == "sampler":
            return ""
        return "full" if self.model_id else "lora"

    @property
    def name(self) -> str:
        """A Kubernetes name (DNS label, at most 52 characters so pod names and labels fit)."""
        role = f"{self.role}-full" if self.model_id else self.role
        subject = self.model_id or self.base_model
        return f"openrl-{role}-{safe_slug(subject, 52 - len('openrl-') - len(role) - 1)}"


def safe_slug(text: str, limit: int) -> str:
    """Lower-case letters, digits and '-', at most `limit` long; a hash keeps distinct texts distinct."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:6]
    readable = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[: max(limit - 7, 1)].strip("-")
    return f"{readable}-{digest}" if readable else digest


def is_active(activity: Activity, now: datetime, idle: timedelta) -> bool:
    if activity.pending > 0:
        return True
    return not activity.session_finished and now - activity.last_request < idle


def wanted_workers(
    activities: Iterable[Activity], now: datetime, idle: timedelta, floor: Iterable[str] = ()
) -> dict[WorkerSpec, list[str]]:
    """Every worker wanted now -> the keys of the runs and sessions that want it ('floor' for the floor)."""
    wanted: dict[WorkerSpec, list[str]] = {}
    for base_model in floor:
        for role in ("trainer", "sampler"):
            wanted.setdefault(WorkerSpec(role, base_model), []).append("floor")
    for activity in sorted(activities, key=lambda a: (a.tenant, a.key)):
        if not is_active(activity, now, idle):
            continue
        if activity.kind == "sampling":
            spec = WorkerSpec("sampler", activity.base_model)
        elif activity.kind == "full":
            spec = WorkerSpec("trainer", activity.base_model, model_id=activity.key)
        else:
            spec = WorkerSpec("trainer", activity.base_model)
        wanted.setdefault(spec, []).append(activity.key)
    return wanted


def waiting_since(activities: Iterable[Activity], spec: WorkerSpec) -> Optional[datetime]:
    """The oldest unfinished request among the runs a worker serves: how long its clients have waited."""
    oldest = [
        a.oldest_pending for a in activities if a.oldest_pending is not None and a.pending > 0 and serves(spec, a)
    ]
    return min(oldest, default=None)


def serves(spec: WorkerSpec, activity: Activity) -> bool:
    if activity.base_model != spec.base_model:
        return False
    if spec.role == "sampler":
        return activity.kind == "sampling"
    if spec.model_id is not None:
        return activity.kind == "full" and activity.key == spec.model_id
    return activity.kind == "lora"
