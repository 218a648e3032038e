"""A session's timeline as a Chrome trace (the JSON Perfetto and chrome://tracing open).

Built from the event store alone, which is what makes it exact: every request of a session
has a `…requested` event (the gateway's time: when it was queued), a `…started` event (the
worker's: when it got the model and a timeslicer turn) and a `…completed` or `…failed`
event (when it finished), each stamped with its request id (`subject`), the worker that
wrote it (`source`) and the timeslicer lease it ran under. From them:

- one process per worker (`source` of the started/finished events; the gateway for a request
  no worker took up), one thread per model or sampling session (`key`) in it;
- per request, a complete event (`ph: "X"`) `queued <verb>` from requested to started, and
  `<verb>` from started to finished, with its request id, phase times and outcome in args.
  The start is the `…started` event's time or, where the worker emits none (the trainer),
  the `started` its completion records; a request with no recorded start (the sampler's)
  is one `<verb>` slice from requested to finished;
- per key, its timeslicer turns: a run of consecutive finished requests under one lease id
  is one `turn <lease>` slice on the worker's `turns` thread for that key;
- when the node's timeslicer answered, its own entries (`lease`, `park`, `restore`) for the
  session's runs, on a `timeslicer` process, one thread per device.

Slices on one thread must nest (the trace format's rule for `X` events); requests of one
model can overlap (queued together, sampled in one batch), so each thread is split into as
many lanes as it needs, greedily, earliest start first. Times are microseconds since the
Unix epoch (`ts`, `dur`, integers). A request still open ends at `now` and says so.
Pure: no I/O; the gateway reads the rows and serves the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable, Optional, Protocol

FORMAT = "openrl.session_trace.v1"
GATEWAY = "/openrl/gateway"
FINISHED = ("completed", "failed")


class Envelope(Protocol):
    type: str
    source: str
    key: Optional[str]
    subject: Optional[str]
    time: datetime
    lease_id: Optional[int]
    started: Optional[datetime]  # a completion's record of when the work began, if it has one


def micros(moment: datetime) -> int:
    return int(round(moment.timestamp() * 1_000_000))


@dataclass
class Request:
    request_id: str
    key: str
    family: str
    verb: str
    requested: Optional[datetime] = None
    started: Optional[datetime] = None
    finished: Optional[datetime] = None
    outcome: Optional[str] = None  # "completed" | "failed"
    worker: Optional[str] = None
    lease_id: Optional[int] = None


@dataclass
class _Slice:
    process: str
    thread: str
    name: str
    start_us: int
    end_us: int
    category: str
    args: dict[str, Any] = field(default_factory=dict)


def requests_of(envelopes: Iterable[Envelope]) -> list[Request]:
    """Fold the lifecycle events (`ai.openrl.<family>.<verb>.<phase>.vN`) into requests."""
    found: dict[str, Request] = {}
    for envelope in envelopes:
        parts = envelope.type.split(".")
        if len(parts) != 6 or envelope.subject is None or envelope.key is None:
            continue
        family, verb, phase = parts[2], parts[3], parts[4]
        if phase not in ("requested", "started", *FINISHED):
            continue
        request = found.setdefault(envelope.subject, Request(envelope.subject, envelope.key, family, verb))
        if phase == "requested":
            request.requested = envelope.time
        elif phase == "started":
            request.started = envelope.time
            request.worker = envelope.source
        else:
            # A redelivered request can finish twice (at least once); the first answer counts.
            if request.finished is None:
                request.finished, request.outcome = envelope.time, phase
                request.worker = request.worker or envelope.source
                request.lease_id = envelope.lease_id
                request.started = request.started or getattr(envelope, "started", None)
    # A `…completed` with no request before it is a record (a session's creation), not a request.
    requests = [r for r in found.values() if r.requested is not None or r.started is not None]
    return sorted(requests, key=lambda r: (r.requested or r.started, r.request_id))


def _request_slices(request: Request, label: str, now: datetime) -> list[_Slice]:
    process = request.worker or GATEWAY
    args = {
        "request_id": request.request_id,
        "key": request.key,
        "requested": request.requested.isoformat() if request.requested else None,
        "started": request.started.isoformat() if request.started else None,
        "finished": request.finished.isoformat() if request.finished else None,
        "outcome": request.outcome or "open",
        "lease_id": request.lease_id,
    }
    out = []
    end = request.finished or now
    begin = request.started or request.finished
    if request.requested is not None:
        queued_end = begin or now
        out.append(
            _Slice(
                process,
                f"{label} queue",
                f"queued {request.verb}",
                micros(request.requested),
                micros(queued_end),
                "queued",
                args,
            )  # fmt: skip
        )
    if request.started is not None:
        out.append(_Slice(process, label, request.verb, micros(request.started), micros(end), request.family, args))
    elif request.requested is not None and request.finished is not None:
        # The worker recorded no start (the sampler does not): one slice from queued to done.
        out[-1] = _Slice(process, label, request.verb, micros(request.requested), micros(end), request.family,
                         {**args, "note": "the worker recorded no start; queued and running together"})  # fmt: skip
    return out


def _turn_slices(requests: list[Request], labels: dict[str, str]) -> list[_Slice]:
    """Consecutive finished requests of one key under one lease: one timeslicer turn."""
    out: list[_Slice] = []
    by_key: dict[tuple[str, str], list[tuple[datetime, Request]]] = {}
    for request in requests:
        if request.finished is not None and request.lease_id is not None and request.worker:
            by_key.setdefault((request.worker, request.key), []).append((request.finished, request))
    for (worker, key), finished in by_key.items():
        finished.sort(key=lambda pair: pair[0])
        items = [request for _, request in finished]
        ends = {id(request): end for end, request in finished}
        turn: list[Request] = []
        for request in [*items, None]:
            if turn and (request is None or request.lease_id != turn[0].lease_id):
                start = min(r.started or ends[id(r)] for r in turn)
                out.append(
                    _Slice(
                        worker,
                        f"{labels.get(key, key)} turns",
                        f"turn {turn[0].lease_id}",
                        micros(start),
                        micros(ends[id(turn[-1])]),
                        "timeslicer",
                        {"lease_id": turn[0].lease_id, "requests": [r.request_id for r in turn]},
                    )  # fmt: skip
                )
                turn = []
            if request is not None:
                turn.append(request)
    return out


def _timeslicer_slices(entries: dict[str, list[dict]], now: datetime) -> list[_Slice]:
    out = []
    for device, items in entries.items():
        for entry in items:
            start, end = entry.get("start"), entry.get("end")
            if not isinstance(start, (int, float)):
                continue
            end_s = end if isinstance(end, (int, float)) else now.timestamp()
            name = f"{entry.get('kind', 'lease')} {entry.get('run_id') or entry.get('holder', '')}".strip()
            args = {k: v for k, v in entry.items() if k not in ("start", "end")}
            out.append(
                _Slice(
                    "timeslicer",
                    f"device {device}",
                    name,
                    int(round(start * 1e6)),
                    int(round(end_s * 1e6)),
                    "timeslicer",
                    args,
                )  # fmt: skip
            )
    return out


def build(
    session_id: str,
    envelopes: Iterable[Envelope],
    labels: dict[str, str],
    now: datetime,
    timeslicer: Optional[dict[str, list[dict]]] = None,
) -> dict[str, Any]:
    """The trace of one session. `labels` names each key's thread (e.g. "run <model id>")."""
    requests = requests_of(envelopes)
    slices: list[_Slice] = []
    for request in requests:
        slices.extend(_request_slices(request, labels.get(request.key, request.key), now))
    slices.extend(_turn_slices(requests, labels))
    slices.extend(_timeslicer_slices(timeslicer or {}, now))
    return {
        "traceEvents": _events(slices),
        "displayTimeUnit": "ms",
        "otherData": {"format": FORMAT, "session_id": session_id, "requests": len(requests)},
    }


def _events(slices: list[_Slice]) -> list[dict[str, Any]]:
    """Number processes and threads, split overlapping threads into lanes, and write the
    `X` events after the `M` (metadata) events that name them."""
    processes: dict[str, int] = {}
    threads: dict[tuple[int, str], int] = {}
    lanes: dict[tuple[str, str], list[int]] = {}  # (process, thread) -> each lane's last end
    events: list[dict[str, Any]] = []
    slices = sorted(slices, key=lambda s: (s.start_us, -s.end_us, s.process, s.thread, s.name))
    for piece in slices:
        pid = processes.setdefault(piece.process, len(processes) + 1)
        ends = lanes.setdefault((piece.process, piece.thread), [])
        lane = next((i for i, last in enumerate(ends) if last <= piece.start_us), None)
        if lane is None:
            lane = len(ends)
            ends.append(0)
        ends[lane] = piece.end_us
        thread = piece.thread if lane == 0 else f"{piece.thread} ({lane + 1})"
        tid = threads.setdefault((pid, thread), len(threads) + 1)
        events.append(
            {
                "name": piece.name,
                "cat": piece.category,
                "ph": "X",
                "ts": piece.start_us,
                "dur": max(0, piece.end_us - piece.start_us),
                "pid": pid,
                "tid": tid,
                "args": piece.args,
            }  # fmt: skip
        )
    meta = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}
        for name, pid in processes.items()
    ]
    meta += [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
        for (pid, name), tid in threads.items()
    ]
    return meta + events
