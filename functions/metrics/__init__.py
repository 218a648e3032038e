"""The metrics function: Prometheus metrics folded from the event stream.

It reads every OpenRL event (the log consumer, `openrl metrics`, or CloudEvents pushed over
HTTP to `new().handle` by a KafkaSource) into one pure fold (`state.MetricsState`): request
counters by tenant, base model and type (requested, completed, failed by category,
cancelled), latency histograms from each `…requested` event time to its `…completed` or
`…failed` event time, queue depths, and trained and sampled tokens (totals and per second).
A redelivered event id is counted once. `GET /metrics` serves the Prometheus text format.
"""

from functions.metrics.exposition import Metrics
from functions.metrics.service import MetricsFunction, MetricsService
from functions.metrics.state import MetricsState


def new() -> MetricsFunction:
    return MetricsFunction()


__all__ = ["Metrics", "MetricsFunction", "MetricsService", "MetricsState", "new"]
