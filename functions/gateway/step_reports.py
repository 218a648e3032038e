"""Step metrics a client reports through the tinker SDK's telemetry, picked out of a batch.

The SDK sends `POST /api/v1/telemetry` batches of events; a generic event named
`openrl.step_metrics` whose data holds `run_id` (one of the caller's training runs), `step`
(an integer from 1: the run's optim_step number the numbers belong to, the `step` of
`openrl runs show --metrics`; the server does not check that such a step exists yet, since
the telemetry batch may arrive before the step is applied) and numbers under names of its own becomes one
`ClientStepMetrics` event on the run's key, stored with every other event. From a script:

    training.get_telemetry().log("openrl.step_metrics", {"run_id": training.model_id, "step": 3, "reward": 0.7})

Telemetry is best effort, and one bad entry must not cost the batch its other events (the
SDK drops a batch the server refuses): an entry that is not well formed, names a run the
caller does not own, or carries no finite number is skipped, never an error. Names are kept
as the client sent them, at most MAX_METRICS of at most MAX_NAME characters each.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

from openrl_core.events.sessions import ClientStepMetrics
from openrl_core.wire.sessions import TelemetryEvent

EVENT_NAME = "openrl.step_metrics"
RESERVED = ("run_id", "step")
MAX_METRICS = 64
MAX_NAME = 100
MAX_STEP = 2**31 - 1


def _finite(value: object) -> Optional[float]:
    """The value as a finite float, or None (not a number, a bool, NaN, infinite, or an integer past float's range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def step_report(event: TelemetryEvent, session_id: Optional[str]) -> Optional[ClientStepMetrics]:
    """The report an event carries, or None when it is not one (or not a well-formed one)."""
    if event.event != "GENERIC_EVENT" or event.event_name != EVENT_NAME:
        return None
    data = event.event_data
    run_id, step = data.get("run_id"), data.get("step")
    if not isinstance(run_id, str) or not 0 < len(run_id) <= 200 or not run_id.isprintable():  # no NUL for the database
        return None
    if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= MAX_STEP:
        return None
    metrics = {
        name: number
        for name, value in data.items()
        if name not in RESERVED and isinstance(name, str) and 0 < len(name) <= MAX_NAME
        for number in [_finite(value)]
        if number is not None
    }
    if not metrics or len(metrics) > MAX_METRICS:
        return None
    return ClientStepMetrics(model_id=run_id, step=step, metrics=metrics, session_id=session_id)


def step_reports(
    events: Iterable[TelemetryEvent], session_id: Optional[str], owns_run: Callable[[str], bool]
) -> list[ClientStepMetrics]:
    """The batch's well-formed reports on runs the caller owns (`owns_run` asked once per run)."""
    reports = [r for r in (step_report(e, session_id) for e in events) if r is not None]
    owned = {run: owns_run(run) for run in {r.model_id for r in reports}}
    return [r for r in reports if owned[r.model_id]]
