"""The timeslicer's rules: one holder per accelerator, leases as fencing tokens, residency.

Pure state and no I/O: every operation takes `now` (monotonic seconds) and returns the
effects the daemon must carry out (a grant to send, a park to ask, a lease that ended), so
the rules are tested with hand-built calls and no sockets, threads or clocks.

Terms. A *job* is one unit of device state a worker keeps (a full fine-tuning run's weights,
gradients and optimizer; a LoRA model's adapter and optimizer; a sampler's weights). A
worker connection (*owner*) registers its jobs with the bytes each needs resident, then
asks for a *turn* on the job's device before computing, and releases it after.

Invariants:
- At most one lease per device is current. Lease ids only grow (each is at least the
  injected `lease_floor()`, the daemon's wall clock in ms << 16, so a restarted daemon, or
  one on another node, never reissues a smaller id); an id is a fencing token: once a
  lease ends (released, expired, revoked), every operation on it is refused and events
  stamped with it are refused downstream.
- A holder that does not renew before its deadline loses the device (`tick`); a holder
  whose connection closes loses it at once (`disconnect`). A cancelled acquire leaves no
  waiter behind; a grant that raced the cancel is released by the client.
- Resident bytes on a device never exceed its budget when a grant is sent: before granting
  a job that is not resident and does not fit, the least recently served resident,
  parkable jobs are asked to park, and the grant waits for their answers. A job that never
  answers (a stopped process) is skipped, not waited on forever; non-parkable jobs (frozen
  base weights) always stay resident. A job needing more than its device's budget (with the
  non-parkable bytes beside it) is refused when it registers.
- Policies: FIFO grants in arrival order; LRS grants the waiter whose job was served least
  recently (never served counts as served when it registered). Under both, a waiter older
  than `aging_seconds` goes first (oldest first), so no job starves.
- Registering a job id that another owner holds takes it over (a replacement worker with
  the same identity): the old owner's lease on it is revoked and its waiters refused, so
  a paused-then-resumed old owner cannot get a new turn for it.
- Affinity: jobs may name a group (one training run: its trainer job and its sampler's
  copy). When a job of a group releases, the device waits up to `affinity_seconds` for the
  group's next request (an RL step is several requests: forward_backward, optim_step,
  save, sample), and serves the group's waiters first, for at most `quantum_seconds` in a
  row and never past a waiter older than `aging_seconds`. It does not wait when every owner
  of the group's jobs has asked for another job's turn since the release (they have moved
  on: nobody is left to send the group's next request). Interleaving runs request by
  request would keep them in lockstep (all of them grading while the device idles); letting
  one run finish its step staggers them, so one grades while another trains. A waiter whose
  turn carries a group's work under a job of no group (a sampler batch on the shared base
  weights holding the run's samples: `serves`) counts as that group's next request: the
  device never idles waiting for a request that is already waiting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Optional, Union

from openrl_core.errors import Conflict, InvalidRequest, NotFound


class Policy(str, Enum):
    FIFO = "fifo"
    LRS = "lrs"


# -- effects: what the daemon does after an operation ------------------------------------


@dataclass(frozen=True)
class Grant:
    owner: str
    request: str
    job: str
    device: str
    lease_id: int
    lease_seconds: float
    restore: bool  # the job's state is parked: the worker brings it back under this lease
    waited: float


@dataclass(frozen=True)
class AskPark:
    owner: str
    job: str
    device: str


@dataclass(frozen=True)
class LeaseEnded:
    owner: str
    job: str
    device: str
    lease_id: int
    held: float
    reason: str  # released | expired | disconnected | taken_over | unregistered


@dataclass(frozen=True)
class Refused:
    """An acquire that can never be granted any more; its caller gets this error."""

    owner: str
    request: str
    error: str


Effect = Union[Grant, AskPark, LeaseEnded, Refused]


# -- state ---------------------------------------------------------------------------------


@dataclass
class Job:
    job: str
    owner: str
    device: str
    bytes: int
    parkable: bool
    resident: bool
    registered_at: float
    group: Optional[str] = None
    last_served: Optional[float] = None
    parking_since: Optional[float] = None  # asked to park, no answer yet
    unresponsive: bool = False  # a park ask timed out: not asked again until it answers

    @property
    def served_key(self) -> float:
        return self.last_served if self.last_served is not None else self.registered_at


@dataclass
class Waiter:
    job: str
    owner: str
    request: str
    since: float
    also: tuple[str, ...] = ()  # more jobs of the same owner served by the same turn (a packed pass)
    serves: tuple[str, ...] = ()  # groups whose work the turn carries (see Affinity above)

    @property
    def jobs(self) -> tuple[str, ...]:
        return (self.job, *self.also)


@dataclass
class Lease:
    lease_id: int
    job: str
    owner: str
    device: str
    granted_at: float
    deadline: float
    also: tuple[str, ...] = ()

    @property
    def jobs(self) -> tuple[str, ...]:
        return (self.job, *self.also)


@dataclass
class Device:
    name: str
    budget: Optional[int]  # None: no limit (nothing is ever parked)
    holder: Optional[Lease] = None
    waiters: list[Waiter] = field(default_factory=list)
    next_up: Optional[Waiter] = None  # chosen, waiting for parks before its grant
    busy_seconds: float = 0.0  # sum of lease hold times
    switches: int = 0  # grants to a job other than the previous holder's
    affinity: Optional[tuple[str, float, float]] = None  # (group, until, released at): held for its next request
    streak: Optional[tuple[str, float]] = None  # (group, since): the group being served in a row


class Timeslicer:
    def __init__(
        self,
        budgets: dict[str, Optional[int]],
        policy: Policy = Policy.FIFO,
        lease_seconds: float = 10.0,
        aging_seconds: float = 30.0,
        park_timeout: float = 30.0,
        lease_floor: Callable[[], int] = lambda: 0,
        affinity_seconds: float = 0.0,
        quantum_seconds: float = 10.0,
    ) -> None:
        if not budgets:
            raise InvalidRequest("a timeslicer needs at least one device")
        if lease_seconds <= 0 or aging_seconds <= 0 or park_timeout <= 0:
            raise InvalidRequest("lease_seconds, aging_seconds and park_timeout must be positive")
        self.devices = {name: Device(name, budget) for name, budget in budgets.items()}
        self.policy = Policy(policy)
        self.lease_seconds = lease_seconds
        self.aging_seconds = aging_seconds
        self.park_timeout = park_timeout
        self.lease_floor = lease_floor
        self.affinity_seconds = affinity_seconds
        self.quantum_seconds = quantum_seconds
        self.jobs: dict[str, Job] = {}
        self.last_lease_id = 0
        self.expired_leases = 0
        self._last_job: dict[str, Optional[str]] = {name: None for name in budgets}

    # -- operations ------------------------------------------------------------------------

    def register(
        self,
        owner: str,
        job: str,
        device: str,
        nbytes: int,
        parkable: bool,
        resident: bool,
        now: float,
        group: Optional[str] = None,
    ) -> list[Effect]:
        """Add a job, update its bytes, or take it over from another owner."""
        if not job:
            raise InvalidRequest("register needs a job name")
        state = self.devices.get(device)
        if state is None:
            raise InvalidRequest(f"unknown device {device!r}; this node has {sorted(self.devices)}")
        if not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidRequest(f"job {job!r}: bytes must be a non-negative integer, got {nbytes!r}")
        pinned = sum(j.bytes for j in self._on(device) if not j.parkable and j.job != job)
        if state.budget is not None and nbytes + pinned > state.budget:
            raise InvalidRequest(
                f"job {job!r} needs {nbytes} bytes resident but device {device} has a budget of {state.budget} bytes"
                + (f", {pinned} of them held by jobs that never park" if pinned else "")
            )
        effects: list[Effect] = []
        existing = self.jobs.get(job)
        if existing is not None and (existing.owner != owner or existing.device != device):
            effects += self._drop(existing, "taken_over", now)
            existing = None
        if existing is None:
            self.jobs[job] = Job(job, owner, device, nbytes, parkable, resident, registered_at=now, group=group)
        else:
            existing.bytes, existing.parkable, existing.resident, existing.group = nbytes, parkable, resident, group
        return effects + self._schedule(state, now)

    def acquire(
        self, owner: str, job: str, request: str, now: float, also: tuple[str, ...] = (), serves: tuple[str, ...] = ()
    ) -> list[Effect]:
        """Wait for a turn of `job`; `also` names more jobs of the same owner on the same device
        that the turn serves together (one packed pass over several models): all of them are
        made resident before the grant, and the one lease covers them. `serves` names the
        groups whose work the turn carries (for affinity)."""
        state = self._owned(owner, job)
        device = self.devices[state.device]
        also = tuple(dict.fromkeys(j for j in also if j != job))
        for other in also:
            if self._owned(owner, other).device != state.device:
                raise InvalidRequest(f"job {other!r} is on another device than {job!r}; one turn is one device")
        busy = {j for w in device.waiters for j in w.jobs} | (set(device.holder.jobs) if device.holder else set())
        taken = sorted(busy & {job, *also})
        if taken:
            raise Conflict(f"job {taken[0]!r} already holds or waits for a turn; release it first")
        device.waiters.append(Waiter(job, owner, request, now, also, tuple(serves)))
        return self._schedule(device, now)

    def cancel(self, owner: str, request: str, now: float) -> list[Effect]:
        """Withdraw a waiting acquire (no-op if it was granted or never existed)."""
        for device in self.devices.values():
            before = len(device.waiters)
            device.waiters = [w for w in device.waiters if not (w.owner == owner and w.request == request)]
            if device.next_up is not None and device.next_up.owner == owner and device.next_up.request == request:
                device.next_up = None
            if len(device.waiters) != before:
                return self._schedule(device, now)
        return []

    def release(self, owner: str, lease_id: int, now: float) -> list[Effect]:
        device, lease = self._current(owner, lease_id)
        return self._end(device, lease, "released", now) + self._schedule(device, now)

    def renew(self, owner: str, lease_id: int, now: float) -> float:
        """Push the lease's deadline out; returns the seconds it now has."""
        _device, lease = self._current(owner, lease_id)
        lease.deadline = now + self.lease_seconds
        return self.lease_seconds

    def parked(self, owner: str, job: str, now: float) -> list[Effect]:
        state = self._owned(owner, job)
        state.resident, state.parking_since, state.unresponsive = False, None, False
        return self._schedule(self.devices[state.device], now)

    def unregister(self, owner: str, job: str, now: float) -> list[Effect]:
        state = self._owned(owner, job)
        device = self.devices[state.device]
        return self._drop(state, "unregistered", now) + self._schedule(device, now)

    def disconnect(self, owner: str, now: float) -> list[Effect]:
        """The owner is gone: its jobs, their memory, its leases and its waiters with it."""
        effects: list[Effect] = []
        touched = set()
        for state in [j for j in self.jobs.values() if j.owner == owner]:
            effects += self._drop(state, "disconnected", now)
            touched.add(state.device)
        for device in self.devices.values():
            if any(w.owner == owner for w in device.waiters):
                device.waiters = [w for w in device.waiters if w.owner != owner]
                touched.add(device.name)
        for name in sorted(touched):
            effects += self._schedule(self.devices[name], now)
        return effects

    def tick(self, now: float) -> list[Effect]:
        """Expire overdue leases and give up on park asks nobody answers."""
        effects: list[Effect] = []
        for device in self.devices.values():
            lease = device.holder
            if lease is not None and now >= lease.deadline:
                self.expired_leases += 1
                effects += self._end(device, lease, "expired", now)
            for state in self._on(device.name):
                if state.parking_since is not None and now - state.parking_since >= self.park_timeout:
                    state.parking_since, state.unresponsive = None, True
            effects += self._schedule(device, now)
        return effects

    def is_current(self, lease_id: int) -> bool:
        return any(d.holder is not None and d.holder.lease_id == lease_id for d in self.devices.values())

    # -- views -----------------------------------------------------------------------------

    def status(self, now: float) -> list[dict]:
        out = []
        for device in self.devices.values():
            holder = device.holder
            out.append(
                {
                    "device": device.name,
                    "budget_bytes": device.budget,
                    "resident_bytes": self._resident_bytes(device.name),
                    "holder": None
                    if holder is None
                    else {"job": holder.job, "lease_id": holder.lease_id, "deadline": max(0.0, holder.deadline - now)},
                    "waiters": [{"job": w.job, "waiting_seconds": now - w.since} for w in device.waiters],
                    "residents": [
                        {"job": j.job, "bytes": j.bytes, "parked": not j.resident, "parkable": j.parkable}
                        for j in sorted(self._on(device.name), key=lambda j: j.job)
                    ],
                    "busy_seconds": device.busy_seconds + (now - holder.granted_at if holder else 0.0),
                    "switches": device.switches,
                }
            )
        return out

    # -- internals -------------------------------------------------------------------------

    def _on(self, device: str) -> list[Job]:
        return [j for j in self.jobs.values() if j.device == device]

    def _resident_bytes(self, device: str) -> int:
        return sum(j.bytes for j in self._on(device) if j.resident)

    def _owned(self, owner: str, job: str) -> Job:
        state = self.jobs.get(job)
        if state is None:
            raise NotFound(f"job {job!r} is not registered")
        if state.owner != owner:
            raise Conflict(f"job {job!r} was taken over by another worker (fenced)")
        return state

    def _current(self, owner: str, lease_id: int) -> tuple[Device, Lease]:
        for device in self.devices.values():
            lease = device.holder
            if lease is not None and lease.lease_id == lease_id and lease.owner == owner:
                return device, lease
        raise Conflict(f"lease {lease_id} is not current (released, expired or taken over: fenced)")

    def _end(self, device: Device, lease: Lease, reason: str, now: float) -> list[Effect]:
        held = max(0.0, now - lease.granted_at)
        device.holder = None
        device.busy_seconds += held
        for name in lease.jobs:
            served = self.jobs.get(name)
            if served is not None and served.owner == lease.owner:
                served.last_served = now
        job = self.jobs.get(lease.job)
        if job is not None and job.owner == lease.owner:
            if reason == "released" and job.group is not None and self.affinity_seconds > 0:
                device.affinity = (job.group, now + self.affinity_seconds, now)
        return [LeaseEnded(lease.owner, lease.job, device.name, lease.lease_id, held, reason)]

    def _drop(self, state: Job, reason: str, now: float) -> list[Effect]:
        """Forget a job: end its lease, refuse its waiters."""
        device = self.devices[state.device]
        effects: list[Effect] = []
        if device.holder is not None and state.job in device.holder.jobs:
            effects += self._end(device, device.holder, reason, now)
        for waiter in [w for w in device.waiters if state.job in w.jobs]:
            effects.append(Refused(waiter.owner, waiter.request, f"job {state.job!r} is gone ({reason})"))
        device.waiters = [w for w in device.waiters if state.job not in w.jobs]
        if device.next_up is not None and state.job in device.next_up.jobs:
            device.next_up = None
        del self.jobs[state.job]
        return effects

    def _ordered(self, device: Device, now: float) -> list[Waiter]:
        """Waiters in the order the policy serves them; a job with a park in flight waits
        for its answer (it will come back with a restore)."""
        eligible = [w for w in device.waiters if all(self.jobs[j].parking_since is None for j in w.jobs)]
        aged = sorted((w for w in eligible if now - w.since >= self.aging_seconds), key=lambda w: w.since)
        rest = [w for w in eligible if now - w.since < self.aging_seconds]
        if self.policy is Policy.LRS:
            rest.sort(key=lambda w: (self.jobs[w.job].served_key, w.since))
        return aged + rest

    def _needed(self, waiter: Waiter) -> int:
        return sum(self.jobs[j].bytes for j in waiter.jobs if not self.jobs[j].resident)

    def _fits(self, device: Device, waiter: Waiter) -> bool:
        return device.budget is None or self._resident_bytes(device.name) + self._needed(waiter) <= device.budget

    def _schedule(self, device: Device, now: float) -> list[Effect]:
        if device.holder is not None or not device.waiters:
            return []
        order = self._ordered(device, now)
        if device.next_up is not None and device.next_up in order:
            order.remove(device.next_up)
            order.insert(0, device.next_up)
        if not order:
            return []
        if device.affinity is not None and device.next_up is None:
            group, until, released = device.affinity
            in_quantum = (
                device.streak is None or device.streak[0] != group or now - device.streak[1] < self.quantum_seconds
            )
            aged = any(now - w.since >= self.aging_seconds for w in order)
            same = [w for w in order if self.jobs[w.job].group == group or group in w.serves]
            if in_quantum and not aged and same:
                order = same + [w for w in order if w not in same]
            elif in_quantum and not aged and now < until and not self._moved_on(group, released, order):
                return []  # the group's next request is on its way: the device waits for it
            else:
                device.affinity = None
        chosen = order[0]
        if self._fits(device, chosen):
            return self._grant(device, chosen, now)
        effects = self._make_room(device, chosen, now)
        if effects or any(j.parking_since is not None for j in self._on(device.name)):
            device.next_up = chosen
            return effects
        # No room can be made now (every other resident never parks or does not answer):
        # rather than idle, serve a waiter that fits until the chosen one can be placed.
        device.next_up = None
        for waiter in order[1:]:
            if self._fits(device, waiter):
                return self._grant(device, waiter, now)
        return []

    def _moved_on(self, group: str, released: float, order: list[Waiter]) -> bool:
        """Whether no one is left to send the group's next request soon: every owner of the
        group's jobs has, since the release, asked for a turn of another job. A worker takes
        one turn at a time, so one that asks for another run's turn has moved on, and waiting
        for the released run would only idle the device (a trainer serving many LoRA runs in
        turn would idle at every switch). A run's other owner (its sampler) keeps the wait."""
        owners = {job.owner for job in self.jobs.values() if job.group == group}
        asked = {waiter.owner for waiter in order if waiter.since >= released}
        return bool(owners) and owners <= asked

    def _grant(self, device: Device, waiter: Waiter, now: float) -> list[Effect]:
        job = self.jobs[waiter.job]
        device.next_up = None
        device.waiters.remove(waiter)
        self.last_lease_id = max(self.last_lease_id + 1, int(self.lease_floor()))
        lease = Lease(self.last_lease_id, job.job, job.owner, device.name, now, now + self.lease_seconds, waiter.also)
        device.holder = lease
        if self._last_job[device.name] != job.job:
            device.switches += 1
            self._last_job[device.name] = job.job
        if job.group is None or device.streak is None or device.streak[0] != job.group:
            device.streak = (job.group, now) if job.group is not None else None
        device.affinity = None
        restore = not job.resident
        for name in waiter.jobs:
            self.jobs[name].resident = True
        return [
            Grant(
                job.owner,
                waiter.request,
                job.job,
                device.name,
                lease.lease_id,
                self.lease_seconds,
                restore,
                now - waiter.since,
            )
        ]

    def _make_room(self, device: Device, waiter: Waiter, now: float) -> list[Effect]:
        """Ask least recently served residents to park until the waiter's jobs fit (counting
        parks in flight)."""
        if device.budget is None:  # (never: without a budget every waiter fits)
            return []
        needed = self._needed(waiter)
        free = device.budget - self._resident_bytes(device.name)
        in_flight = sum(j.bytes for j in self._on(device.name) if j.parking_since is not None)
        effects: list[Effect] = []
        victims = sorted(
            (
                j
                for j in self._on(device.name)
                if j.resident
                and j.parkable
                and j.job not in waiter.jobs
                and j.parking_since is None
                and not j.unresponsive
            ),
            key=lambda j: (j.served_key, j.job),
        )
        for victim in victims:
            if free + in_flight >= needed:
                break
            victim.parking_since = now
            in_flight += victim.bytes
            effects.append(AskPark(victim.owner, victim.job, device.name))
        return effects
