"""Which telemetry events become step reports (functions/gateway/step_reports.py): a table of
well-formed and malformed `openrl.step_metrics` events, and the ownership filter."""

from __future__ import annotations

import pytest

from functions.gateway.step_reports import step_report, step_reports
from openrl_core.wire.sessions import TelemetryEvent


def event(data, name="openrl.step_metrics", kind="GENERIC_EVENT") -> TelemetryEvent:
    return TelemetryEvent(event=kind, event_name=name, event_data=data)


@pytest.mark.parametrize(
    "data, metrics",
    [
        ({"run_id": "r1", "step": 3, "reward": 0.5}, {"reward": 0.5}),
        ({"run_id": "r1", "step": 1, "reward": 1, "acc": 0.25, "note": "x"}, {"reward": 1.0, "acc": 0.25}),
        ({"run_id": "r1", "step": 1, "reward": True, "ok": 2.0}, {"ok": 2.0}),  # a bool is no number
        ({"run_id": "r1", "step": 1, "big": 10**400, "nan": float("nan"), "r": -1.5}, {"r": -1.5}),
        ({"run_id": "r1", "step": "1", "reward": 0.5}, None),  # a step must be an integer
        ({"run_id": "r1", "step": 0, "reward": 0.5}, None),
        ({"run_id": "r1", "step": True, "reward": 0.5}, None),
        ({"run_id": 7, "step": 1, "reward": 0.5}, None),
        ({"run_id": "", "step": 1, "reward": 0.5}, None),
        ({"step": 1, "reward": 0.5}, None),
        ({"run_id": "r1", "step": 1, "note": "text only"}, None),
        ({"run_id": "r1", "step": 1, **{f"m{i}": i for i in range(65)}}, None),  # more than 64 numbers
        ({"run_id": "r1", "step": 1, "x" * 101: 1.0}, None),
    ],
)
def test_a_report_is_a_run_a_step_and_finite_numbers(data, metrics):
    report = step_report(event(data), "s1")
    if metrics is None:
        assert report is None
    else:
        assert (report.model_id, report.step, report.metrics, report.session_id) == ("r1", data["step"], metrics, "s1")


def test_other_events_are_not_reports_and_foreign_runs_are_dropped():
    assert step_report(event({"run_id": "r1", "step": 1, "reward": 1.0}, name="other"), None) is None
    assert step_report(event({"run_id": "r1", "step": 1, "reward": 1.0}, kind="SESSION_START"), None) is None
    asked = []

    def owns(run: str) -> bool:
        asked.append(run)
        return run == "mine"

    batch = [event({"run_id": run, "step": s, "reward": 0.1 * s}) for run in ("mine", "theirs") for s in (1, 2)]
    kept = step_reports(batch, None, owns)
    assert [(r.model_id, r.step) for r in kept] == [("mine", 1), ("mine", 2)]
    assert sorted(asked) == ["mine", "theirs"]  # once per run, not per event
