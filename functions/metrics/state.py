"""The metrics as a pure fold over events: `MetricsState.apply(event)`, no I/O, no clock.

What it keeps, and why each piece is bounded:
- counters of requests by (tenant, base model, type): requested, completed, failed (by
  category) and cancelled; events by (tenant, family.verb.phase). Tenants and base models
  come from configuration, types from the catalogue; request and model ids are never keys.
- one latency histogram per (base model, type, outcome): the time from a request's
  `…requested` event to its `…completed`/`…failed` event, both event times (CloudEvent
  `time`), so a replay of the same events gives the same histograms.
- the open requests (requested, not yet finished): the queue depth, and what a completion
  needs to be labelled and timed. It is as large as the real backlog.
- finishes seen before their request ("early"): topics carry no order between them, and a
  consumer catching up reads a tenant's completions topic before its training topic. An
  early finish waits for its request, so it is labelled and timed like any other; one whose
  request never comes (it was before this state began, or the log dropped it) is counted by
  `settle` with the labels the completion alone gives (base model from its key, else
  `unknown`), and the request, should it come after all, then counts but never queues.
- model id / sampling session id -> base model, learnt from the events that create them
  (completions name only their request), capped at `max_models`, oldest forgotten first.
- tokens: target tokens of completed forward_backward batches (not forward-only ones: they
  train nothing) and generated tokens of completed samples, as counters, plus the recent
  completions (one `rate_window` of event time) behind the tokens-per-second gauges.
- the ids of the last `dedup_window` events applied: a redelivered event is recognised and
  counted once. The service saves this state at least every half window of events and
  commits log offsets only after saving, so whatever the log delivers again is in the window.
The type label is the verb (`forward_backward`, `sample`, …), `forward` for forward-only.
"""

from __future__ import annotations

import math
import uuid
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Optional

from openrl_core.events import Event
from openrl_core.events.lifecycle import RequestCompleted, RequestFailed, SamplingSessionBound

# Upper bounds in seconds: from a 5 ms sample on a warm model to a 10 min checkpoint save.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
UNKNOWN = "unknown"
TRAINING, SAMPLING = "training", "sampling"
VERSION = 1


@dataclass
class Finish:
    """A …completed, …failed or …cancelled event, reduced to what the counters need."""

    tenant: str
    key: str  # the event's partition key: a model or sampling session id
    verb: str
    outcome: str  # completed | failed | cancelled
    category: str  # a failure's category; "" otherwise
    at: float
    sampled: int  # tokens a completed sample generated


@dataclass
class OpenRequest:
    tenant: str
    base_model: str
    type: str
    requested_at: float  # epoch seconds of the …requested event
    tokens: int  # target tokens a forward_backward trains on; 0 otherwise


class Histogram:
    def __init__(self, counts: Optional[list[int]] = None, total: float = 0.0) -> None:
        self.counts = counts or [0] * (len(BUCKETS) + 1)  # per bucket, the last one is +Inf
        self.sum = total

    def observe(self, seconds: float) -> None:
        index = next((i for i, bound in enumerate(BUCKETS) if seconds <= bound), len(BUCKETS))
        self.counts[index] += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        bounds = [repr(bound) for bound in BUCKETS] + ["+Inf"]
        running, out = 0, []
        for bound, count in zip(bounds, self.counts):
            running += count
            out.append((bound, running))
        return out


class IdWindow:
    """The last `size` ids, with O(1) membership."""

    def __init__(self, size: int, ids: tuple[str, ...] = ()) -> None:
        self.order: deque[str] = deque(maxlen=size)
        self.members: set[str] = set()
        for event_id in ids:
            self.add(event_id)

    def __contains__(self, event_id: str) -> bool:
        return event_id in self.members

    def add(self, event_id: str) -> None:
        if len(self.order) == self.order.maxlen:
            self.members.discard(self.order[0])
        self.order.append(event_id)
        self.members.add(event_id)


class MetricsState:
    def __init__(
        self,
        dedup_window: int = 100_000,
        rate_window: float = 60.0,
        max_models: int = 100_000,
        max_early: int = 100_000,
    ) -> None:
        # The lineage of this state: the service names its consumer group after it, so
        # committed offsets always belong to the state that saw the records before them.
        self.epoch = uuid.uuid4().hex[:12]
        self.dedup_window = dedup_window
        self.rate_window = rate_window
        self.max_models = max_models
        self.max_early = max_early
        self.requested: Counter[tuple[str, str, str]] = Counter()
        self.completed: Counter[tuple[str, str, str]] = Counter()
        self.failed: Counter[tuple[str, str, str, str]] = Counter()
        self.cancelled: Counter[tuple[str, str, str]] = Counter()
        self.events: Counter[tuple[str, str]] = Counter()
        self.depth: Counter[tuple[str, str, str]] = Counter()  # keys stay at 0: a series must not vanish
        self.latency: dict[tuple[str, str, str], Histogram] = {}
        self.tokens: Counter[tuple[str, str, str]] = Counter()  # (kind, tenant, base model)
        self.recent_tokens: deque[tuple[float, str, str, str, int]] = deque()
        self.open: dict[str, OpenRequest] = {}
        self.early: OrderedDict[str, Finish] = OrderedDict()
        self.settled = IdWindow(dedup_window)  # request ids whose finish was settled unmatched
        self.models: OrderedDict[str, str] = OrderedDict()
        self.seen = IdWindow(dedup_window)
        self.duplicates = 0
        self.latest = 0.0  # the latest event time applied

    # -- the fold ---------------------------------------------------------------------------

    def apply(self, event: Event) -> bool:
        """Fold one event in; False (and nothing changes but a count) for a redelivery."""
        if event.id in self.seen:
            self.duplicates += 1
            return False
        self.seen.add(event.id)
        at = event.time.timestamp()
        self.latest = max(self.latest, at)
        self.events[(event.tenant, ".".join(event.type.split(".")[2:5]))] += 1
        data = event.data
        self._learn_models(data)
        if event.phase == "requested" and hasattr(data, "request_id"):
            self._requested(event, at)
        elif isinstance(data, (RequestCompleted, RequestFailed)) or event.phase == "cancelled":
            self._finished(event, at)
        self._forget_old_tokens(self.latest)
        return True

    def _requested(self, event: Event, at: float) -> None:
        data = event.data
        base = getattr(data, "base_model", None) or self.models.get(getattr(data, "model_id", None) or "", UNKNOWN)
        forward_only = bool(getattr(data, "forward_only", False))
        type_ = "forward" if forward_only else event.verb
        key = (event.tenant, base, type_)
        self.requested[key] += 1
        self.depth.setdefault(key, 0)
        if data.request_id in self.open or data.request_id in self.settled:
            return  # the same request again under a new event id, or one already finished
        tokens = target_tokens(data) if event.verb == "forward_backward" and not forward_only else 0
        request = OpenRequest(event.tenant, base, type_, at, tokens)
        finish = self.early.pop(data.request_id, None)
        if finish is not None:
            self._count(finish, request)  # it had finished already: it never queues
            return
        self.open[data.request_id] = request
        self.depth[key] += 1

    def _finished(self, event: Event, at: float) -> None:
        data = event.data
        if isinstance(data, RequestCompleted):
            outcome, category = "completed", ""
        elif isinstance(data, RequestFailed):
            outcome, category = "failed", data.category
        else:
            outcome, category = "cancelled", ""
        sampled = generated_tokens(data.result) if outcome == "completed" and event.verb == "sample" else 0
        finish = Finish(event.tenant, event.key or "", event.verb, outcome, category, at, sampled)
        pending = self.open.pop(data.request_id, None)
        if pending is not None:
            self.depth[(pending.tenant, pending.base_model, pending.type)] -= 1
            self._count(finish, pending)
            return
        self.early[data.request_id] = finish
        while len(self.early) > self.max_early:
            self._settle_one(next(iter(self.early)))

    def settle(self, before: Optional[float] = None) -> int:
        """Count the early finishes (those before `before`, in event time) as unmatched.

        Call it when no request can still come for them: the log consumer does when a poll
        finds every partition at its end (a request is always appended before its finish).
        """
        due = [rid for rid, finish in self.early.items() if before is None or finish.at < before]
        for request_id in due:
            self._settle_one(request_id)
        return len(due)

    def _settle_one(self, request_id: str) -> None:
        finish = self.early.pop(request_id)
        self.settled.add(request_id)
        self._count(finish, None)

    def _count(self, finish: Finish, request: Optional[OpenRequest]) -> None:
        if request is not None:
            tenant, base, type_ = request.tenant, request.base_model, request.type
        else:
            tenant, base, type_ = finish.tenant, self.models.get(finish.key, UNKNOWN), finish.verb
        key = (tenant, base, type_)
        if finish.outcome == "completed":
            self.completed[key] += 1
            if request is not None and request.tokens:
                self._add_tokens(finish.at, TRAINING, tenant, base, request.tokens)
            if finish.sampled:
                self._add_tokens(finish.at, SAMPLING, tenant, base, finish.sampled)
        elif finish.outcome == "failed":
            self.failed[(*key, finish.category)] += 1
        else:
            self.cancelled[key] += 1
        if request is not None and finish.outcome != "cancelled":
            # Worker and gateway clocks may disagree by a little; a latency is never negative.
            latency = max(0.0, finish.at - request.requested_at)
            self.latency.setdefault((base, type_, finish.outcome), Histogram()).observe(latency)

    def _learn_models(self, data: Any) -> None:
        base = getattr(data, "base_model", None)
        if base:
            for field in ("model_id", "sampling_session_id"):
                if getattr(data, field, None):
                    self._remember_model(getattr(data, field), base)
        bound = getattr(data, "sampling_session", None)
        if isinstance(bound, SamplingSessionBound):
            self._remember_model(bound.sampling_session_id, bound.base_model)

    def _remember_model(self, object_id: str, base: str) -> None:
        self.models[object_id] = base
        self.models.move_to_end(object_id)
        while len(self.models) > self.max_models:
            self.models.popitem(last=False)

    def _add_tokens(self, at: float, kind: str, tenant: str, base: str, count: int) -> None:
        self.tokens[(kind, tenant, base)] += count
        if at > self.latest - self.rate_window:  # older ones can never be in a rate window again
            self.recent_tokens.append((at, kind, tenant, base, count))

    def _forget_old_tokens(self, now: float) -> None:
        while self.recent_tokens and self.recent_tokens[0][0] <= now - self.rate_window:
            self.recent_tokens.popleft()

    # -- reading ----------------------------------------------------------------------------

    def tokens_per_second(self, now: float) -> dict[tuple[str, str, str], float]:
        """Tokens completed in the trailing window ending at `now` (epoch s), per second."""
        rates = {key: 0.0 for key in self.tokens}
        for at, kind, tenant, base, count in self.recent_tokens:
            if now - self.rate_window < at <= now:
                rates[(kind, tenant, base)] += count / self.rate_window
        return rates

    # -- persistence ------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "epoch": self.epoch,
            "requested": _rows(self.requested),
            "completed": _rows(self.completed),
            "failed": _rows(self.failed),
            "cancelled": _rows(self.cancelled),
            "events": _rows(self.events),
            "depth": _rows(self.depth),
            "tokens": _rows(self.tokens),
            "latency": [[*key, h.counts, h.sum] for key, h in self.latency.items()],
            "recent_tokens": [list(row) for row in self.recent_tokens],
            "open": {rid: [o.tenant, o.base_model, o.type, o.requested_at, o.tokens] for rid, o in self.open.items()},
            "early": [
                [rid, f.tenant, f.key, f.verb, f.outcome, f.category, f.at, f.sampled] for rid, f in self.early.items()
            ],
            "settled": list(self.settled.order),
            "models": list(self.models.items()),
            "seen": list(self.seen.order),
            "duplicates": self.duplicates,
            "latest": self.latest,
        }

    @classmethod
    def from_json(
        cls, saved: dict[str, Any], dedup_window: int, rate_window: float, max_models: int = 100_000
    ) -> "MetricsState":
        if saved.get("version") != VERSION:
            raise ValueError(f"metrics state version {saved.get('version')!r}, expected {VERSION}")
        state = cls(dedup_window, rate_window, max_models)
        state.epoch = saved["epoch"]
        for name in ("requested", "completed", "failed", "cancelled", "events", "depth", "tokens"):
            getattr(state, name).update({tuple(row[:-1]): row[-1] for row in saved[name]})
        state.latency = {tuple(row[:3]): Histogram(list(row[3]), row[4]) for row in saved["latency"]}
        state.recent_tokens = deque(tuple(row) for row in saved["recent_tokens"])
        state.open = {rid: OpenRequest(*row) for rid, row in saved["open"].items()}
        state.early = OrderedDict((row[0], Finish(*row[1:])) for row in saved["early"])
        state.settled = IdWindow(dedup_window, tuple(saved["settled"]))
        for object_id, base in saved["models"]:
            state._remember_model(object_id, base)
        state.seen = IdWindow(dedup_window, tuple(saved["seen"]))
        state.duplicates = saved["duplicates"]
        state.latest = saved["latest"]
        return state


def _rows(counter: Counter) -> list[list]:
    return [[*key, value] for key, value in counter.items()]


def target_tokens(data: Any) -> int:
    """Target tokens of a forward_backward batch, from array shapes alone (nothing decoded)."""
    total = 0
    for datum in getattr(data, "data", None) or []:
        targets = datum.loss_fn_inputs.get("target_tokens")
        shape = targets.shape if targets is not None else datum.tokens.shape
        total += math.prod(shape)
    return total


def generated_tokens(result: dict[str, Any]) -> int:
    return sum(len(sequence.get("tokens") or []) for sequence in result.get("sequences") or [])
