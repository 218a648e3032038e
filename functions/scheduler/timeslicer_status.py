"""The scheduler's reader of a node timeslicer's `GET /status`: typed, validated, nothing else.

The timeslicer daemon (`openrl timeslicer … --http-port 9465`) reports each accelerator it
arbitrates: its memory budget, the bytes resident, the current lease holder, the waiters
and the resident jobs (parked or not). The scheduler uses the budget as the device's
capacity and counts residents it did not place as reserved memory. A body of another shape
is refused with what was wrong (`TimeslicerStatusError`), never half-read; fields this
reader does not know (the daemon also reports duty cycle, switches, uptime...) are ignored,
so a newer daemon does not break an older scheduler. A worker's jobs are named
`<worker instance>/<what>` (its pod name first), which is how the scheduler recognises its own.
"""

from __future__ import annotations

from typing import Literal, Optional

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from openrl_core.errors import ServerError


class TimeslicerStatusError(ServerError):
    """A timeslicer could not be reached or answered something that is not its status."""


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class Holder(_Strict):
    job: str
    lease_id: int
    deadline: float


class Waiter(_Strict):
    job: str
    waiting_seconds: float = Field(ge=0)


class Resident(_Strict):
    job: str
    bytes: int = Field(ge=0)
    parked: bool


class DeviceStatus(_Strict):
    device: str
    budget_bytes: Optional[int] = Field(None, ge=0)  # None: the daemon enforces no limit
    resident_bytes: int = Field(ge=0)
    holder: Optional[Holder] = None
    waiters: list[Waiter] = []
    residents: list[Resident] = []

    @field_validator("device")
    @classmethod
    def _indexed(cls, value: str) -> str:
        kind, sep, index = value.partition(":")
        if not sep or not index.isdigit() or not kind:
            raise ValueError(f"device {value!r} is not '<kind>:<index>' (e.g. cuda:0)")
        return value

    @property
    def index(self) -> int:
        return int(self.device.partition(":")[2])

    def foreign_bytes(self, ours: set[str]) -> int:
        """Resident bytes of jobs the scheduler did not place (parked ones hold no device memory).
        `ours` are worker names; a job belongs to a worker when it is named `<worker>/...`."""
        return sum(r.bytes for r in self.residents if not r.parked and not owned_by(r.job, ours))


def owned_by(job: str, workers) -> bool:
    return any(job == worker or job.startswith(worker + "/") or job.startswith(worker + "-") for worker in workers)


class NodeStatus(_Strict):
    node: str
    policy: Literal["fifo", "lrs"]
    devices: list[DeviceStatus]


def parse_status(body: bytes | str) -> NodeStatus:
    try:
        return NodeStatus.model_validate_json(body)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5])
        raise TimeslicerStatusError(f"not a timeslicer status: {problems}") from None


def fetch_status(base_url: str, timeout: float = 2.0) -> NodeStatus:
    """GET <base_url>/status; a timeslicer that is down or answers badly raises TimeslicerStatusError."""
    try:
        response = httpx.get(base_url.rstrip("/") + "/status", timeout=timeout)
    except httpx.HTTPError as exc:
        raise TimeslicerStatusError(f"timeslicer at {base_url} unreachable: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise TimeslicerStatusError(f"timeslicer at {base_url} answered {response.status_code}")
    return parse_status(response.content)
