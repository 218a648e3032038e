"""The timeslicer service: the core rules behind a lock, speaking the wire protocol.

Transport-free: a transport (the Unix-socket daemon, or the in-process link `openrl serve`
uses) calls `connect(sink)` for each worker connection, `handle(owner, message)` for each
request line and `disconnect(owner)` when the link drops; every answer and push goes out
through the owner's sink. A malformed or unknown message gets an error reply to its
sender and changes nothing, so one bad client never stops the others being served.

Protocol (JSON objects, one per line; `docs/timeslicer.md` is the reference):
    {"op": "hello", "id": 1, "worker": "trainer-a"}        -> devices, policy, lease_seconds
    {"op": "register", "id": 2, "job", "device", "bytes", "parkable", "resident", "group"}
    {"op": "acquire", "id": 3, "job", "also": [jobs], "serves": [groups]}  -> answered when granted:
                                      {"id": 3, "ok": true, "lease_id", "lease_seconds", "restore", "device"}
    {"op": "cancel", "id": 4, "request": 3}   {"op": "renew"|"release"|"validate", "id", "lease_id"}
    {"op": "parked"|"restored", "id", "job", "seconds", "bytes"}   {"op": "unregister", "id", "job"}
    {"op": "status", "id"}   {"op": "timeline", "id", "since": unix seconds}
    pushes: {"push": "park", "job"}   {"push": "revoked", "lease_id", "job", "reason"}
Errors: {"id": ..., "ok": false, "error": "...", "code": 400|404|409}.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections import deque
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from openrl_core.errors import InvalidRequest, OpenRLError
from openrl_core.timeslice import AskPark, Effect, Grant, LeaseEnded, Policy, Refused, Timeslicer

log = logging.getLogger(__name__)
Sink = Callable[[dict], None]
TIMELINE = 4096  # leases and parks remembered per device, for `timeline` (dashboards, benchmarks)
SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


def lease_floor() -> int:
    """Wall-clock milliseconds << 16: ids from a restarted daemon, or another node's, do
    not fall below ones issued before (clocks in sync to within a lease's lifetime)."""
    return (time.time_ns() // 1_000_000) << 16


class SlicerService:
    def __init__(
        self,
        budgets: dict[str, Optional[int]],
        policy: Policy = Policy.FIFO,
        lease_seconds: float = 10.0,
        aging_seconds: float = 30.0,
        park_timeout: float = 30.0,
        node: Optional[str] = None,
        clock: Callable[[], float] = time.monotonic,
        affinity_seconds: float = 0.0,
        quantum_seconds: float = 10.0,
    ) -> None:
        self.core = Timeslicer(
            budgets, policy, lease_seconds, aging_seconds, park_timeout, lease_floor, affinity_seconds, quantum_seconds
        )
        self.node = node or socket.gethostname()
        self.clock = clock
        self.started = clock()
        self._lock = threading.RLock()
        self._sinks: dict[str, Sink] = {}
        self._workers: dict[str, str] = {}
        self._pending: dict[tuple[str, str], int] = {}  # (owner, request) -> the acquire's message id
        self._owners = itertools.count(1)
        # per device: parks and restores as workers report them (count, seconds, bytes)
        self._moves = {d: {"parks": 0, "park_seconds": 0.0, "park_bytes": 0, "restores": 0, "restore_seconds": 0.0,
                           "restore_bytes": 0} for d in budgets}  # fmt: skip
        # Who held each device when, and when jobs parked: wall-clock (unix) seconds.
        self._timeline: dict[str, deque] = {d: deque(maxlen=TIMELINE) for d in budgets}
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics()

    # -- connections -----------------------------------------------------------------------

    def connect(self, sink: Sink) -> str:
        with self._lock:
            owner = f"c{next(self._owners)}"
            self._sinks[owner] = sink
            return owner

    def disconnect(self, owner: str) -> None:
        with self._lock:
            if owner not in self._sinks:
                return
            effects = self.core.disconnect(owner, self.clock())
            del self._sinks[owner]
            self._workers.pop(owner, None)
            self._pending = {k: v for k, v in self._pending.items() if k[0] != owner}
            self._deliver(effects)

    def tick(self) -> None:
        with self._lock:
            self._deliver(self.core.tick(self.clock()))
            self._refresh_gauges()

    # -- requests --------------------------------------------------------------------------

    def handle(self, owner: str, message) -> None:
        """Apply one request; its answer (now, or for acquire when granted) goes to the sink."""
        with self._lock:
            request_id = message.get("id") if isinstance(message, dict) else None
            try:
                if not isinstance(message, dict):
                    raise InvalidRequest("a message must be a JSON object")
                op = message.get("op")
                handler = self._ops.get(op) if isinstance(op, str) else None
                if handler is None:
                    raise InvalidRequest(f"unknown op {op!r}; expected one of {sorted(self._ops)}")
                reply = handler(self, owner, message)
            except OpenRLError as error:
                self._send(owner, {"id": request_id, "ok": False, "error": error.detail, "code": error.http_status})
                if "lease" in error.detail and "fenced" in error.detail:
                    self.m_fenced.inc()
                return
            except (KeyError, TypeError, ValueError) as error:
                self._send(
                    owner,
                    {"id": request_id, "ok": False, "error": f"malformed {message.get('op')!r}: {error}", "code": 400},
                )
                return
            if reply is not None:
                self._send(owner, {"id": request_id, "ok": True, **reply})
            self._refresh_gauges()

    def _hello(self, owner: str, message: dict) -> dict:
        self._workers[owner] = str(message.get("worker", owner))
        budgets = {name: device.budget for name, device in self.core.devices.items()}
        return {
            "node": self.node,
            "devices": budgets,
            "policy": self.core.policy.value,
            "lease_seconds": self.core.lease_seconds,
        }

    def _register(self, owner: str, message: dict) -> dict:
        effects = self.core.register(
            owner,
            _text(message, "job"),
            _text(message, "device"),
            _int(message, "bytes"),
            bool(message.get("parkable", True)),
            bool(message.get("resident", False)),
            self.clock(),
            group=str(message["group"]) if message.get("group") else None,
        )
        self._deliver(effects)
        return {}

    def _acquire(self, owner: str, message: dict) -> None:
        request = str(message["id"])
        self._pending[(owner, request)] = message["id"]
        also = message.get("also") or ()
        if not isinstance(also, (list, tuple)) or not all(isinstance(j, str) and j for j in also):
            raise InvalidRequest("'acquire' takes `also` as a list of job names")
        serves = message.get("serves") or ()
        if not isinstance(serves, (list, tuple)) or not all(isinstance(g, str) and g for g in serves):
            raise InvalidRequest("'acquire' takes `serves` as a list of group names")
        try:
            effects = self.core.acquire(owner, _text(message, "job"), request, self.clock(), tuple(also), tuple(serves))
        except OpenRLError:
            self._pending.pop((owner, request), None)
            raise
        self._deliver(effects)
        return None  # answered by the Grant effect

    def _cancel(self, owner: str, message: dict) -> dict:
        request = str(message["request"])
        self._pending.pop((owner, request), None)
        self._deliver(self.core.cancel(owner, request, self.clock()))
        return {}

    def _renew(self, owner: str, message: dict) -> dict:
        return {"lease_seconds": self.core.renew(owner, _int(message, "lease_id"), self.clock())}

    def _release(self, owner: str, message: dict) -> dict:
        self._deliver(self.core.release(owner, _int(message, "lease_id"), self.clock()))
        return {}

    def _validate(self, owner: str, message: dict) -> dict:
        lease_id = _int(message, "lease_id")
        current = self.core.is_current(lease_id) and any(
            d.holder is not None and d.holder.owner == owner and d.holder.lease_id == lease_id
            for d in self.core.devices.values()
        )
        if not current:
            self.m_fenced.inc()
        return {"current": current}

    def _parked(self, owner: str, message: dict) -> dict:
        job = _text(message, "job")
        device = self._device_of(job)
        self._deliver(self.core.parked(owner, job, self.clock()))
        self._moved(device, "park", float(message.get("seconds", 0.0)), _int(message, "bytes", 0), job)
        return {}

    def _restored(self, owner: str, message: dict) -> dict:
        job = _text(message, "job")
        self._moved(self._device_of(job), "restore", float(message.get("seconds", 0.0)), _int(message, "bytes", 0), job)
        return {}

    def _timeline_op(self, owner: str, message: dict) -> dict:
        return {"timeline": self.timeline(float(message.get("since", 0.0)))}

    def timeline(self, since: float = 0.0) -> dict[str, list[dict]]:
        """Per device, the leases (job, lease id, start, end, reason) and parks/restores that
        ended at or after `since` (unix seconds), oldest first; the last few thousand only."""
        with self._lock:
            return {d: [e for e in entries if e["end"] >= since] for d, entries in self._timeline.items()}

    def _record(self, device: str, entry: dict) -> None:
        if device in self._timeline:
            self._timeline[device].append(entry)

    def _moved(self, device: str, kind: str, seconds: float, nbytes: int, job: str) -> None:
        end = time.time()
        self._record(device, {"kind": kind, "job": job, "start": end - seconds, "end": end, "bytes": nbytes})
        {"park": self.m_park_seconds, "restore": self.m_restore_seconds}[kind].labels(device).observe(seconds)
        {"park": self.m_park_bytes, "restore": self.m_restore_bytes}[kind].labels(device).inc(nbytes)
        moves = self._moves.get(device)
        if moves is not None:
            moves[f"{kind}s"] += 1
            moves[f"{kind}_seconds"] += seconds
            moves[f"{kind}_bytes"] += nbytes

    def _unregister(self, owner: str, message: dict) -> dict:
        self._deliver(self.core.unregister(owner, _text(message, "job"), self.clock()))
        return {}

    def _status(self, owner: str, message: dict) -> dict:
        return {"status": self.status()}

    _ops = {
        "hello": _hello,
        "register": _register,
        "acquire": _acquire,
        "cancel": _cancel,
        "renew": _renew,
        "release": _release,
        "validate": _validate,
        "parked": _parked,
        "restored": _restored,
        "unregister": _unregister,
        "status": _status,
        "timeline": _timeline_op,
    }

    # -- views -----------------------------------------------------------------------------

    def status(self) -> dict:
        with self._lock:
            now = self.clock()
            devices = self.core.status(now)
            owners = {j.job: self._workers.get(j.owner, j.owner) for j in self.core.jobs.values()}
            for device in devices:
                for entry in device["residents"]:
                    entry["worker"] = owners.get(entry["job"])
                uptime = max(now - self.started, 1e-9)
                device["duty_cycle"] = device["busy_seconds"] / uptime
                device.update(self._moves.get(device["device"], {}))
            return {
                "node": self.node,
                "policy": self.core.policy.value,
                "lease_seconds": self.core.lease_seconds,
                "uptime_seconds": now - self.started,
                "lease_expiries": self.core.expired_leases,
                "devices": devices,
            }

    def metrics_text(self) -> bytes:
        with self._lock:
            self._refresh_gauges()
            return generate_latest(self.registry)

    # -- internals -------------------------------------------------------------------------

    def _device_of(self, job: str) -> str:
        state = self.core.jobs.get(job)
        return state.device if state is not None else "unknown"

    def _send(self, owner: str, message: dict) -> None:
        sink = self._sinks.get(owner)
        if sink is None:
            return
        try:
            sink(message)
        except Exception:  # a dead link is noticed by its transport, which disconnects it
            log.debug("timeslicer: could not send to %s", owner, exc_info=True)

    def _deliver(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Grant):
                message_id = self._pending.pop((effect.owner, effect.request), effect.request)
                self.m_wait.labels(effect.device).observe(effect.waited)
                self._send(
                    effect.owner,
                    {
                        "id": message_id,
                        "ok": True,
                        "lease_id": effect.lease_id,
                        "lease_seconds": effect.lease_seconds,
                        "restore": effect.restore,
                        "device": effect.device,
                        "job": effect.job,
                    },
                )
            elif isinstance(effect, AskPark):
                self._send(effect.owner, {"push": "park", "job": effect.job, "device": effect.device})
            elif isinstance(effect, LeaseEnded):
                self.m_hold.labels(effect.device).observe(effect.held)
                end = time.time()
                self._record(effect.device, {"kind": "lease", "job": effect.job, "lease_id": effect.lease_id,
                                             "start": end - effect.held, "end": end, "reason": effect.reason})  # fmt: skip
                if effect.reason == "expired":
                    self.m_expiries.labels(effect.device).inc()
                if effect.reason != "released":
                    self._send(
                        effect.owner,
                        {"push": "revoked", "lease_id": effect.lease_id, "job": effect.job, "reason": effect.reason},
                    )
            elif isinstance(effect, Refused):
                message_id = self._pending.pop((effect.owner, effect.request), effect.request)
                self._send(effect.owner, {"id": message_id, "ok": False, "error": effect.error, "code": 409})

    def _metrics(self) -> None:
        r = self.registry
        self.m_wait = Histogram(
            "openrl_timeslicer_wait_seconds", "time from acquire to grant", ["device"], registry=r, buckets=SECONDS
        )
        self.m_hold = Histogram(
            "openrl_timeslicer_hold_seconds", "time a lease was held", ["device"], registry=r, buckets=SECONDS
        )
        self.m_park_seconds = Histogram(
            "openrl_timeslicer_park_seconds",
            "time a worker took to park a job",
            ["device"],
            registry=r,
            buckets=SECONDS,
        )
        self.m_restore_seconds = Histogram(
            "openrl_timeslicer_restore_seconds",
            "time a worker took to restore a job",
            ["device"],
            registry=r,
            buckets=SECONDS,
        )
        self.m_park_bytes = Counter(
            "openrl_timeslicer_park_bytes", "bytes moved to host memory by parks", ["device"], registry=r
        )
        self.m_restore_bytes = Counter(
            "openrl_timeslicer_restore_bytes", "bytes moved back by restores", ["device"], registry=r
        )
        self.m_expiries = Counter(
            "openrl_timeslicer_lease_expiries", "leases that lapsed without renewal", ["device"], registry=r
        )
        self.m_fenced = Counter(
            "openrl_timeslicer_fenced", "operations refused because their lease was no longer current", registry=r
        )
        self.m_queue = Gauge("openrl_timeslicer_queue_depth", "waiters per device", ["device"], registry=r)
        self.m_switches = Gauge(
            "openrl_timeslicer_switches", "grants that changed the device's job", ["device"], registry=r
        )
        self.m_duty = Gauge("openrl_timeslicer_duty_cycle", "share of uptime a lease was held", ["device"], registry=r)
        self.m_resident = Gauge("openrl_timeslicer_resident_bytes", "bytes of resident jobs", ["device"], registry=r)
        self.m_budget = Gauge("openrl_timeslicer_budget_bytes", "memory budget (-1: none)", ["device"], registry=r)
        # Every device's series exist from the start, at zero, so dashboards and rate()s see them.
        for device in self.core.devices:
            for metric in (self.m_wait, self.m_hold, self.m_park_seconds, self.m_restore_seconds, self.m_park_bytes,
                           self.m_restore_bytes, self.m_expiries, self.m_queue, self.m_switches, self.m_duty,
                           self.m_resident, self.m_budget):  # fmt: skip
                metric.labels(device)

    def _refresh_gauges(self) -> None:
        now = self.clock()
        uptime = max(now - self.started, 1e-9)
        for entry in self.core.status(now):
            name = entry["device"]
            self.m_queue.labels(name).set(len(entry["waiters"]))
            self.m_switches.labels(name).set(entry["switches"])
            self.m_duty.labels(name).set(entry["busy_seconds"] / uptime)
            self.m_resident.labels(name).set(entry["resident_bytes"])
            self.m_budget.labels(name).set(-1 if entry["budget_bytes"] is None else entry["budget_bytes"])


def _text(message: dict, key: str) -> str:
    value = message.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{message.get('op')!r} needs a non-empty string {key!r}")
    return value


def _int(message: dict, key: str, default: Optional[int] = None) -> int:
    value = message.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{message.get('op')!r} needs an integer {key!r}")
    return value
