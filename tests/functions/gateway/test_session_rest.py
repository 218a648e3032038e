"""search_sessions, assign_session_project and export_session_trace at the gateway: filters,
pages and bad input; a project move that replays; and a trace whose every slice agrees with
the stored events' times. The SDK's own calls of the three run in tests/e2e (surface cases)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from urllib.parse import urlsplit

from sqlalchemy import select

from eventing.replay import replay
from eventing.store import database, tables
from eventing.store.event_store import EventStore
from eventing.store.queries import Projections
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.events.lifecycle import RequestCompleted, RequestStarted
from openrl_core.events.sessions import SESSION_PROJECT_ASSIGNED
from tests.functions.gateway.rest_rig import BOB, assert_clear_4xx, rest  # noqa: F401  (fixture)

SEARCH = "/api/v1/sessions/search"


def search(rest, body, key=None):
    response = rest.request("POST", SEARCH, body, **({"key": key} if key else {}))
    assert response.status_code == 200, response.text
    return response.json()


def test_search_filters_and_pages_newest_first(rest):
    night = rest.session(display_name="Nightly SFT run", user_metadata={"team": "rl"}, project_id="p1")
    other = rest.session(display_name="ablation", user_metadata={"team": "sl"})
    third = rest.session(display_name="nightly RL", user_metadata={"team": "rl", "x": "1"})
    rest.ok("POST", f"/api/v1/sessions/{other}/finish", {"reason": {"type": "errored"}})
    rest.session(key=BOB, display_name="nightly bob")

    everything = search(rest, {})
    assert [s["session_id"] for s in everything["sessions"]] == [third, other, night]  # bob's is not there
    assert everything["next_cursor"] is None
    assert {s["owner"] for s in everything["sessions"]} == {"alice"}
    by_id = {s["session_id"]: s for s in everything["sessions"]}
    assert by_id[night]["project_id"] == "p1" and by_id[other]["project_id"] == "default"
    assert by_id[other]["status"] == {"type": "client_finished", "reason": {"type": "errored"}}
    assert by_id[night]["status"] == {"type": "active"} and by_id[night]["checkpoints_count"] == 0

    assert [s["session_id"] for s in search(rest, {"display_name": "NIGHTLY run"})["sessions"]] == [night]
    either = search(rest, {"display_name": "ablation", "session_id": third})["sessions"]
    assert [s["session_id"] for s in either] == [third, other]
    assert [s["session_id"] for s in search(rest, {"user_metadata": {"team": "rl", "x": "1"}})["sessions"]] == [third]
    assert [s["session_id"] for s in search(rest, {"project_ids": ["p1"]})["sessions"]] == [night]
    assert [s["session_id"] for s in search(rest, {"project_ids": ["default"]})["sessions"]] == [third, other]
    active = search(rest, {"statuses": [{"type": "active"}]})["sessions"]
    assert [s["session_id"] for s in active] == [third, night]
    finished = search(rest, {"statuses": [{"type": "client_finished", "reasons": ["errored"]}]})["sessions"]
    assert [s["session_id"] for s in finished] == [other]
    assert search(rest, {"statuses": [{"type": "cancelled"}, {"type": "failed"}]})["sessions"] == []
    assert search(rest, {"owner": {"type": "user", "owner_urns": ["bob"]}})["sessions"] == []
    assert len(search(rest, {"owner": {"type": "user", "owner_urns": ["alice"]}})["sessions"]) == 3
    assert [s["session_id"] for s in search(rest, {"session_id": night}, key=BOB)["sessions"]] == []

    pages, body = [], {"limit": 2}
    while True:
        page = search(rest, body)
        pages.append([s["session_id"] for s in page["sessions"]])
        if page["next_cursor"] is None:
            break
        rest.session(display_name="made between pages")  # newer than the cursor: never on a later page
        body = {"limit": 2, "cursor": page["next_cursor"]}
    assert pages == [[third, other], [night]]


def test_search_refuses_bad_input(rest):
    for body in ({"limit": 0}, {"limit": 201}, {"statuses": []}, {"display_name": ""},
                 {"owner": {"type": "user", "owner_urns": []}}, {"owner": {"type": "someone"}},
                 {"cursor": {"last_created_at": "2026-01-01T00:00:00", "last_session_id": "x"}}):  # fmt: skip
        response = rest.request("POST", SEARCH, body)
        assert 400 <= response.status_code < 500 and response.json()["detail"], (body, response.text)
    assert rest.request("POST", SEARCH, {}, key=None).status_code == 401


def test_assign_project_moves_the_session_and_replays(rest, tmp_path):
    session = rest.session(project_id="p1")
    before = rest.snapshot()
    assert_clear_4xx(rest.request("PUT", f"/api/v1/sessions/{session}/project", {}), 400, "needs a project_id")
    assert_clear_4xx(rest.request("PUT", f"/api/v1/sessions/{session}/project", {"project_id": " "}), 400, "project_id")
    long = {"project_id": "p" * 201}
    assert_clear_4xx(rest.request("PUT", f"/api/v1/sessions/{session}/project", long), 400, "at most 200")
    bob = rest.request("PUT", f"/api/v1/sessions/{session}/project", {"project_id": "p2"}, key=BOB)
    assert_clear_4xx(bob, 404, "unknown session_id")
    assert rest.snapshot() == before and rest.count_events(SESSION_PROJECT_ASSIGNED) == 0

    assert rest.request("PUT", f"/api/v1/sessions/{session}/project", {"project_id": "p2"}).status_code == 200
    assert [s["session_id"] for s in search(rest, {"project_ids": ["p2"]})["sessions"]] == [session]
    assert search(rest, {"project_ids": ["p1"]})["sessions"] == []
    model = rest.model(session)
    runs = rest.ok("GET", "/api/v1/training_runs?project_id=p2")["training_runs"]
    assert [run["training_run_id"] for run in runs] == [model]
    # the projection is a fold of the stored events: rebuilt from them, it holds the move
    engine = database.make_engine(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    database.upgrade(engine)
    report = replay(rest.runtime.store, rest.ctx.projections, EventStore(engine, rest.runtime.store.codec),
                    Projections(engine))  # fmt: skip
    assert report.differences == []
    with engine.connect() as conn:
        assert conn.execute(select(tables.sessions.c.project_id)).scalars().all() == ["p2"]


def _trace(rest, session: str, key=None):
    response = rest.request("GET", f"/api/v1/sessions/{session}/trace_export", **({"key": key} if key else {}))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["status"] == "ready"
    parts = urlsplit(answer["url"])
    download = rest.client.get(f"{parts.path}?{parts.query}")  # no key: the signature is the authorisation
    assert download.status_code == 200, download.text
    return download.json()


def test_trace_slices_agree_with_the_stored_events(rest):
    session = rest.session()
    model = rest.model(session)
    future = rest.ok("POST", "/api/v1/optim_step", {"model_id": model, "seq_id": rest.next_seq(model),
                                                   "adam_params": {"learning_rate": 1e-4}})  # fmt: skip
    request_id = future["request_id"]
    with rest.runtime.engine.connect() as conn:
        requested = conn.execute(select(tables.events.c.time).where(tables.events.c.subject == request_id)).scalar_one()
    requested = requested.replace(tzinfo=requested.tzinfo or timezone.utc)
    started_at, done_at = requested + timedelta(milliseconds=250), requested + timedelta(milliseconds=1250)
    for type_, payload, moment in (
        (te.OPTIM_STEP["started"], RequestStarted(request_id=request_id), started_at),
        (te.OPTIM_STEP["completed"], RequestCompleted(request_id=request_id, result={}), done_at),
    ):
        built = new_event(type_, payload, tenant="alice", source="/openrl/trainer", key=model, subject=request_id,
                          lease=7).model_copy(update={"time": moment})  # fmt: skip
        rest.runtime.store.append(built)

    trace = _trace(rest, session)
    events = trace["traceEvents"]
    assert trace["otherData"]["session_id"] == session
    for event in events:
        assert event["ph"] in ("X", "M") and isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "X":
            assert isinstance(event["ts"], int) and isinstance(event["dur"], int) and event["dur"] >= 0
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M"}
    slices = {e["name"]: e for e in events if e["ph"] == "X" and e["args"].get("request_id") == request_id}

    def us(moment: datetime) -> int:
        return int(round(moment.timestamp() * 1_000_000))

    queued, ran = slices["queued optim_step"], slices["optim_step"]
    assert (queued["ts"], queued["ts"] + queued["dur"]) == (us(requested), us(started_at))
    assert (ran["ts"], ran["ts"] + ran["dur"]) == (us(started_at), us(done_at))
    assert ran["args"]["outcome"] == "completed" and ran["args"]["lease_id"] == 7
    assert names[(ran["pid"], 0)] == "/openrl/trainer" and names[(ran["pid"], ran["tid"])] == f"run {model}"
    turn = next(e for e in events if e["ph"] == "X" and e["name"] == "turn 7")
    assert (turn["ts"], turn["dur"]) == (us(started_at), us(done_at) - us(started_at))
    create = [e for e in events if e["ph"] == "X" and e["name"] == "queued create_model"]
    assert len(create) == 1 and create[0]["args"]["outcome"] == "open"  # no worker ran it here

    # another tenant's session is unknown, and the link's signature covers the tenant
    assert_clear_4xx(rest.request("GET", f"/api/v1/sessions/{session}/trace_export", key=BOB), 404, "unknown session")
    assert _trace(rest, rest.session(key=BOB), key=BOB)["otherData"]["requests"] == 0
