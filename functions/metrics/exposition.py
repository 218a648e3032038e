"""The metrics state behind a lock, saved to disk, and rendered in the Prometheus text format.

`Metrics` is what both front doors (the log consumer and the HTTP function) share: `ingest`
folds decoded events in under a lock, `save` writes the state atomically (temporary file,
fsync, rename, fsync of the folder) and `exposition` renders it through `prometheus-client`
with a custom collector, so the numbers served are exactly the fold's, never a second copy
kept in client-library objects. A saved state from another format version is refused
loudly rather than silently reset.

Series (label sets bounded by configured tenants and base models and by the catalogue):
    openrl_requests_total{tenant,base_model,type}
    openrl_requests_completed_total{tenant,base_model,type}
    openrl_requests_failed_total{tenant,base_model,type,category}
    openrl_requests_cancelled_total{tenant,base_model,type}
    openrl_request_latency_seconds{base_model,type,outcome}       histogram
    openrl_queue_depth{tenant,base_model,type}                     gauge
    openrl_training_tokens_total / openrl_sampled_tokens_total{tenant,base_model}
    openrl_training_tokens_per_second / openrl_sampled_tokens_per_second{tenant,base_model}
    openrl_events_total{tenant,type}                               every event, by family.verb.phase
    openrl_metrics_redeliveries_total                              events recognised as seen before
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from functions.metrics.state import SAMPLING, TRAINING, MetricsState
from openrl_core.events import Event

REQUEST_LABELS = ["tenant", "base_model", "type"]
TOKEN_LABELS = ["tenant", "base_model"]


class Metrics:
    def __init__(
        self, state: MetricsState, path: Optional[Path] = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.state = state
        self.path = Path(path) if path is not None else None
        self.clock = clock  # wall time, for the tokens-per-second window at scrape time
        self.lock = threading.Lock()
        self.unsaved = 0  # events applied since the last save
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    @classmethod
    def load(
        cls, path: Path, dedup_window: int = 100_000, rate_window: float = 60.0, clock: Callable[[], float] = time.time
    ) -> "Metrics":
        """The saved state at `path`, or a fresh one (a new epoch) when there is none."""
        path = Path(path)
        if path.exists():
            state = MetricsState.from_json(json.loads(path.read_bytes()), dedup_window, rate_window)
        else:
            state = MetricsState(dedup_window, rate_window)
        return cls(state, path, clock)

    def ingest(self, events: Iterable[Event]) -> int:
        applied = 0
        with self.lock:
            for event in events:
                applied += self.state.apply(event)
                self.unsaved += 1
        return applied

    def settle(self, grace: Optional[float] = None) -> int:
        """Count finishes whose request has not come: all of them, or those more than
        `grace` seconds (event time) older than the latest event."""
        with self.lock:
            before = None if grace is None else self.state.latest - grace
            return self.state.settle(before)

    def save_due(self) -> bool:
        """Half a dedup window of unsaved events: save before the window could forget one."""
        return self.unsaved >= self.state.dedup_window // 2

    def save(self) -> None:
        if self.path is None:
            return
        with self.lock:
            body = json.dumps(self.state.to_json(), separators=(",", ":")).encode()
            self.unsaved = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        scratch = self.path.with_suffix(".tmp")
        with open(scratch, "wb") as file:
            file.write(body)
            file.flush()
            os.fsync(file.fileno())
        os.replace(scratch, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Collector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self):
        metrics = self.metrics
        with metrics.lock:
            state = metrics.state
            families = [
                _counter("openrl_requests", "Requests submitted (…requested events)", REQUEST_LABELS, state.requested),
                _counter("openrl_requests_completed", "Requests completed", REQUEST_LABELS, state.completed),
                _counter(
                    "openrl_requests_failed",
                    "Requests failed, by error category",
                    [*REQUEST_LABELS, "category"],
                    state.failed,
                ),
                _counter(
                    "openrl_requests_cancelled", "Requests cancelled before they ran", REQUEST_LABELS, state.cancelled
                ),
                _latency(state),
                _gauge("openrl_queue_depth", "Requests submitted and not yet finished", REQUEST_LABELS, state.depth),
            ]
            rates = state.tokens_per_second(metrics.clock())
            for kind, name, what in ((TRAINING, "training", "target tokens of completed forward_backward batches"),
                                     (SAMPLING, "sampled", "tokens generated by completed samples")):  # fmt: skip
                totals = {key[1:]: value for key, value in state.tokens.items() if key[0] == kind}
                per_second = {key[1:]: value for key, value in rates.items() if key[0] == kind}
                families.append(_counter(f"openrl_{name}_tokens", f"Tokens: {what}", TOKEN_LABELS, totals))
                window = f"{state.rate_window:g} s"
                families.append(
                    _gauge(
                        f"openrl_{name}_tokens_per_second",
                        f"Tokens per second over the last {window}: {what}",
                        TOKEN_LABELS,
                        per_second,
                    )  # fmt: skip
                )
            families.append(
                _counter("openrl_events", "Events seen, by family.verb.phase", ["tenant", "type"], state.events)
            )
            redeliveries = CounterMetricFamily("openrl_metrics_redeliveries", "Events delivered again and ignored")
            redeliveries.add_metric([], state.duplicates)
            families.append(redeliveries)
        return families


def _counter(name: str, documentation: str, labels: list[str], values: dict) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family


def _gauge(name: str, documentation: str, labels: list[str], values: dict) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family


def _latency(state: MetricsState) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        "openrl_request_latency_seconds",
        "Seconds from a request's …requested event to its …completed or …failed event",
        labels=["base_model", "type", "outcome"],
    )
    for key, histogram in sorted(state.latency.items()):
        family.add_metric(list(key), histogram.cumulative(), histogram.sum)
    return family
