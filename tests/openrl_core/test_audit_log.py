"""openrl_core.audit_log: which stored events give which audit entry, per filter."""

from __future__ import annotations

from datetime import date, datetime, timezone

import pytest

from openrl_core import audit_log
from openrl_core.errors import InvalidRequest
from openrl_core.events import checkpoints as ce
from openrl_core.events import new_event
from openrl_core.events import sampling as se
from openrl_core.events import sessions as ss
from openrl_core.events import training as te
from openrl_core.events.lifecycle import BlobRef, CheckpointSaved, RequestCompleted

REF = {"adapter.safetensors": BlobRef(sha256="a" * 64, size=10)}
RUN = "s1:train:0"


def ev(type_, payload, key=RUN):
    return new_event(type_, payload, tenant="alice", source="test", key=key, subject="x")


def saved(name="step1", kind="weights"):
    return RequestCompleted(
        request_id="r1", result={}, checkpoint=CheckpointSaved(run_id=RUN, kind=kind, name=name, files=REF)
    )


EVENTS = {
    "saved": ev(te.SAVE_WEIGHTS["completed"], saved()),
    "ephemeral": ev(te.SAVE_WEIGHTS_FOR_SAMPLER["completed"], RequestCompleted(request_id="r2", result={})),
    "deleted": ev(ce.CHECKPOINT_DELETED, ce.CheckpointRemoved(run_id=RUN, checkpoint_id="weights/step1", files=REF)),
    "loaded": ev(te.LOAD_WEIGHTS["requested"], te.LoadWeightsRequested(
        request_id="r3", model_id=RUN, seq_id=3, path=f"tinker://{RUN}/weights/step1", files=REF, with_optimizer=True)),
    "sampler": ev(se.SAMPLING_SESSION_CREATED, se.SamplingSessionCreated(
        sampling_session_id="s1:sample:0", session_id="s1", sampling_session_seq_id=0, base_model="m",
        model_path=f"tinker://{RUN}/sampler_weights/x")),
    "base_sampler": ev(se.SAMPLING_SESSION_CREATED, se.SamplingSessionCreated(
        sampling_session_id="s1:sample:1", session_id="s1", sampling_session_seq_id=1, base_model="m")),
    "assigned": ev(ss.SESSION_PROJECT_ASSIGNED, ss.SessionProjectAssigned(session_id="s1", project_id="p2"), key="s1"),
    "session": ev(ss.SESSION_CREATED, ss.SessionCreated(session_id="s1"), key="s1"),
    "heartbeat": ev(ss.SESSION_HEARTBEAT, ss.SessionHeartbeat(session_id="s1"), key="s1"),
}  # fmt: skip


def named(key, event_type="all"):
    entry = audit_log.entry(EVENTS[key], event_type)
    return entry and (entry["event"], entry.get("tinker_path"), entry.get("purpose"))


def test_checkpoint_events_carry_path_model_and_purpose():
    assert named("saved") == ("checkpoint_saved", f"tinker://{RUN}/weights/step1", None)
    assert audit_log.entry(EVENTS["saved"], "checkpoints")["model_id"] == RUN
    assert named("deleted") == ("checkpoint_deleted", f"tinker://{RUN}/weights/step1", None)
    assert named("loaded") == ("checkpoint_read", f"tinker://{RUN}/weights/step1", "load_weights")
    assert named("sampler") == ("checkpoint_read", f"tinker://{RUN}/sampler_weights/x", "sampling")
    assert named("ephemeral") is None  # no checkpoint kept


def test_event_details_are_the_journal_line_and_non_checkpoint_entries_have_no_deprecated_fields():
    entry = audit_log.entry(EVENTS["assigned"], "all")
    assert entry["event"] == "project_assigned" and entry["event_details"]["ids"]["project_id"] == "p2"
    assert "tinker_path" not in entry and "model_id" not in entry and "purpose" not in entry
    assert audit_log.entry(EVENTS["saved"], "all")["event_details"]["outcome"]["checkpoint"].endswith("weights/step1")


def test_filters():
    assert named("base_sampler") == ("sampling_session_created", None, None)
    assert named("base_sampler", "checkpoints") is None
    assert named("session") == ("session_created", None, None) and named("session", "projects") is None
    assert named("assigned", "projects")[0] == "project_assigned" and named("assigned", "checkpoints") is None
    assert named("heartbeat") is None  # workload, not administration
    assert audit_log.source_types("teams") == [] == audit_log.source_types("organizations")
    for key, event in EVENTS.items():
        for event_type in ("checkpoints", "projects"):
            if audit_log.entry(event, event_type) is not None:  # the store's query reads every type that can give one
                assert event.type in audit_log.source_types(event_type), (key, event_type)


def test_parameters():
    assert audit_log.parse_event_type(None) == "all"
    with pytest.raises(InvalidRequest, match="event_type must be one of"):
        audit_log.parse_event_type("users")
    now = datetime(2026, 7, 13, 23, 59, tzinfo=timezone.utc)
    assert audit_log.parse_day(None, now) == date(2026, 7, 13)
    for bad in ("2026-02-30", "13/07/2026", "2026-07-13T00:00:00"):
        with pytest.raises(InvalidRequest, match="day must be a date"):
            audit_log.parse_day(bad, now)
    start, end = audit_log.day_window(date(2026, 7, 13))
    assert (start.isoformat(), end.isoformat()) == ("2026-07-13T00:00:00+00:00", "2026-07-14T00:00:00+00:00")
