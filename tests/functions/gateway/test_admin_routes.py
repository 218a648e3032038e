"""The AdminClient's routes at the gateway: bad parameters are 400s naming the parameter and
store nothing; each tenant sees only its own audit entries, usage and storage; a checkpoint
deleted or moved with its session's project shows where the SDK documents it. The SDK's own
calls run in tests/e2e/test_sdk_usage.py."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from tests.functions.gateway.rest_rig import BOB, assert_clear_4xx, rest  # noqa: F401  (fixture)

AUDIT, USAGE, STORAGE = "/api/v1/audit", "/api/v1/billing/usage/events", "/api/v1/billing/usage/checkpoints/current"


def hour(offset: int = 0) -> str:
    now = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    return (now + timedelta(hours=offset)).isoformat().replace("+00:00", "Z")


@pytest.mark.parametrize(
    "path, params, fragment",
    [
        (AUDIT, {"event_type": "users"}, "event_type must be one of"),
        (AUDIT, {"day": "2026-13-01"}, "day must be a date"),
        (AUDIT, {"day": "today"}, "day must be a date"),
        (USAGE, {"ending_before": "2026-01-01T00:00:00Z"}, "starting_on"),
        (USAGE, {"starting_on": "2026-01-01T00:00:00Z"}, "ending_before"),
        (USAGE, {"starting_on": "2026-01-01T00:15:00Z", "ending_before": "2026-01-02T00:00:00Z"}, "starting_on must be aligned"),
        (USAGE, {"starting_on": "2026-01-01T00:00:00Z", "ending_before": "soon"}, "ending_before must be an RFC 3339"),
        (USAGE, {"starting_on": "2026-01-02T00:00:00Z", "ending_before": "2026-01-01T00:00:00Z"}, "ending_before must be after"),
        (USAGE, {"starting_on": "2026-01-01T00:00:00Z", "ending_before": "2026-01-16T00:00:00Z"}, "at most 14 days"),
        (STORAGE, {"project_id": " "}, "project_id must be"),
    ],
)  # fmt: skip
def test_bad_parameters_are_a_400_naming_them_and_store_nothing(rest, path, params, fragment):
    before = (rest.snapshot(), rest.count_events())
    assert_clear_4xx(rest.request("GET", path, params=params), 400, fragment)
    assert (rest.snapshot(), rest.count_events()) == before


def test_a_future_window_start_is_a_400(rest):
    response = rest.request("GET", USAGE, params={"starting_on": hour(2), "ending_before": hour(3)})
    assert_clear_4xx(response, 400, "starting_on must not be in the future")


def test_each_tenant_sees_its_own_audit_usage_and_storage(rest):
    session = rest.session(project_id="p1", user_metadata={"team": "rl"})
    model = rest.model(session)
    kept = rest.save(model, "kept")
    gone = rest.save(model, "gone", files={"x": b"12345"})
    rest.ok("DELETE", f"/api/v1/training_runs/{model}/checkpoints/{gone.checkpoint_id}")
    rest.ok("PUT", f"/api/v1/sessions/{session}/project", {"project_id": "p2"})

    entries = rest.ok("GET", AUDIT, params={"event_type": "checkpoints"})["entries"]
    assert [(e["event"], e["tinker_path"]) for e in entries] == [
        ("checkpoint_saved", kept.tinker_path), ("checkpoint_saved", gone.tinker_path), ("checkpoint_deleted", gone.tinker_path),
    ]  # fmt: skip
    assert all(e["model_id"] == model for e in entries)
    everything = [e["event"] for e in rest.ok("GET", AUDIT)["entries"]]
    assert {"project_session_created", "training_run_created", "project_assigned", "checkpoint_deleted"} <= set(
        everything
    )
    assert [e["event"] for e in rest.ok("GET", AUDIT, params={"event_type": "projects"})["entries"]] == [
        "project_session_created", "project_assigned",
    ]  # fmt: skip
    assert rest.ok("GET", AUDIT, params={"event_type": "teams"})["entries"] == []
    assert rest.ok("GET", AUDIT, params={"day": "2020-01-01"})["entries"] == []

    storage = rest.ok("GET", STORAGE)
    assert storage["effective_rate_usd_per_gigabyte_month"] is None
    [row] = storage["data"]
    assert (row["project_id"], row["checkpoint_count"], row["size_bytes"]) == ("p2", 1, kept.size_bytes)
    assert row["size_gigabytes"] == kept.size_bytes / 1e9 and row["estimated_monthly_cost_usd"] is None
    assert rest.ok("GET", STORAGE, params={"project_id": "p1"})["data"] == []

    usage = rest.ok("GET", USAGE, params={"starting_on": hour(-1), "ending_before": hour(1)})
    saves = sum(e["event_info"]["count"] for e in usage["data"] if e["event_info"]["type"] == "checkpoint")
    assert saves == 2  # the deleted one was saved in the window too
    assert {e["project_id"] for e in usage["data"]} == {"p2"} and usage["cost_data_through"] is None
    assert usage["sessions"] == {session: {"user_metadata": {"team": "rl"}}}

    assert rest.ok("GET", AUDIT, key=BOB)["entries"] == []
    assert rest.ok("GET", STORAGE, key=BOB)["data"] == []
    assert rest.ok("GET", USAGE, params={"starting_on": hour(-1), "ending_before": hour(1)}, key=BOB)["data"] == []
