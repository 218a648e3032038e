"""The routes the dashboard adds under /api/openrl/v1, and the page itself, on a gateway with
no workers (completions appended as the projector would): a run's event stream (history,
resume by Last-Event-ID, events stored while it is open, nothing of another run or tenant,
no payload arrays), its sampling throughput (per request and per step), the timeslicer timeline through a real daemon
on its socket (a tenant sees other tenants' turns only as `other`), and the static files.
The browser test against a live server is tests/e2e/test_dashboard_browser.py."""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import select

from eventing.store import tables
from functions.gateway.context import GatewayContext
from functions.gateway.routes import openrl_live
from functions.timeslicer.client import TimeslicerClient, unix_transport
from functions.timeslicer.daemon import Daemon
from functions.timeslicer.service import SlicerService
from functions.timeslicer.setup import socket_path
from openrl_core.events import new_event
from openrl_core.events import training as te
from openrl_core.events.lifecycle import RequestCompleted
from openrl_core.events.sampling import SAMPLE
from tests.functions.gateway.rest_rig import BOB, assert_clear_4xx, rest  # noqa: F401  (fixture)

API = "/api/openrl/v1"
OPERATOR = "tml-rest-operator"


@pytest.fixture
def short_streams(monkeypatch, rest):
    # The test client hands a streamed body over only once the stream ends.
    monkeypatch.setattr(rest.ctx.settings, "event_stream_seconds", 0.5)
    monkeypatch.setattr(openrl_live, "POLL_SECONDS", 0.1)
    return monkeypatch


def sse(text: str) -> list[dict]:
    """The messages of an event stream: each one's id and parsed data."""
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "data" in fields:
            out.append({"sse_id": int(fields["id"]), **json.loads(fields["data"])})
    return out


def test_a_runs_stream_sends_its_history_resumes_and_follows(rest, short_streams):
    session = rest.session()
    run, other_run = rest.model(session), rest.model(session, model_seq_id=1)
    bob_run = rest.model(rest.session(key=BOB), key=BOB)
    for name in ("a", "b"):
        rest.save(run, name)
    rest.save(other_run, "c")
    rest.save(bob_run, "d", key=BOB, tenant="bob")

    events = sse(rest.request("GET", f"{API}/runs/{run}/events").text)
    names = [e["name"] for e in events]
    assert names == [
        "training.create_model.requested",
        *["training.save_weights.requested", "training.save_weights.completed"] * 2,
    ]
    assert all(e["key"] == run and e["schema"] == "openrl.event.v1" for e in events)
    positions = [e["position"] for e in events]
    assert positions == sorted(positions) and [e["sse_id"] for e in events] == positions
    completed = events[2]["fields"]
    assert (
        completed["result"] == "{path}"
        and completed["checkpoint"] == "{run_id, kind, name, files, expires_at, user_metadata}"
    )

    tail = sse(rest.request("GET", f"{API}/runs/{run}/events?history=2").text)
    assert [e["position"] for e in tail] == positions[-2:]
    resumed = sse(rest.request("GET", f"{API}/runs/{run}/events", headers={"Last-Event-ID": str(positions[1])}).text)
    assert [e["position"] for e in resumed] == positions[2:]
    assert sse(rest.request("GET", f"{API}/runs/{run}/events?after={positions[-1]}").text) == []

    # An event stored while the stream is open arrives on it; history=0 sends none of the past.
    short_streams.setattr(rest.ctx.settings, "event_stream_seconds", 2.5)
    later = threading.Timer(0.3, lambda: rest.save(run, "late"))
    later.start()
    started = time.monotonic()
    live = sse(rest.request("GET", f"{API}/runs/{run}/events?history=0").text)
    later.join()
    assert 2.4 < time.monotonic() - started < 15  # the stream ended by itself, at event_stream_seconds
    assert [e["name"] for e in live] == ["training.save_weights.requested", "training.save_weights.completed"]
    assert live[0]["position"] > positions[-1]


def test_a_completion_wakes_an_open_stream_long_before_its_poll(rest, monkeypatch):
    """Over real HTTP (uvicorn): with a 60 s poll, a completion the projector announces still
    reaches an open stream within a few seconds, and the stream ends when the client leaves."""
    import httpx
    import uvicorn

    from functions.local_server import free_port

    monkeypatch.setattr(openrl_live, "POLL_SECONDS", 60.0)
    monkeypatch.setattr(rest.ctx.settings, "event_stream_seconds", 120.0)
    run = rest.model(rest.session())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(rest.client.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}{API}/runs/{run}/events?history=0"
        with httpx.stream("GET", url, headers={"X-API-Key": "tml-rest-alice"}, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("retry:")
            before = time.monotonic()
            rest.save(run, "woken")  # stored as the projector stores a completion...
            with rest.runtime.engine.connect() as conn:
                done = conn.execute(
                    select(tables.futures.c.request_id).where(
                        tables.futures.c.model_id == run, tables.futures.c.kind == "save_weights"
                    )
                ).scalar()
            rest.runtime.notifier.notify([done])  # ...and then announced, as it announces one
            names = []
            for line in lines:
                if line.startswith("data: "):
                    names.append(json.loads(line[6:])["name"])
                if "training.save_weights.completed" in names:
                    break
            assert time.monotonic() - before < 10
            assert names == ["training.save_weights.requested", "training.save_weights.completed"]
        deadline = time.monotonic() + 10
        while rest.ctx.waiters._any and time.monotonic() < deadline:  # the client left: the stream ended
            time.sleep(0.05)
        assert not rest.ctx.waiters._any
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_a_stream_refuses_bad_positions_clearly(rest, short_streams):
    run = rest.model(rest.session())
    assert_clear_4xx(rest.request("GET", f"{API}/runs/{run}/events?after=-1"), 400, "after must be between 0 and")
    assert_clear_4xx(
        rest.request("GET", f"{API}/runs/{run}/events?history=5000"), 400, "history must be between 0 and 1000"
    )
    bad_id = rest.request("GET", f"{API}/runs/{run}/events", headers={"Last-Event-ID": "12abc"})
    assert_clear_4xx(bad_id, 400, "Last-Event-ID must be an event position")
    assert_clear_4xx(rest.request("GET", f"{API}/runs/{run}/events", key=None), 401, "missing X-API-Key")


def test_sampling_throughput_is_tokens_over_the_requests_seconds(rest):
    session = rest.session()
    run = rest.model(session)
    weights = rest.save(run, "s1", kind="sampler_weights")
    sampler = rest.ok(
        "POST",
        "/api/v1/create_sampling_session",
        {"session_id": session, "sampling_session_seq_id": 0, "model_path": weights.tinker_path},
    )
    body = {
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 4},
    }
    request_id = rest.ok("POST", "/api/v1/asample", {"sampling_session_id": sampler["sampling_session_id"], **body})[
        "request_id"
    ]
    assert rest.ok("GET", f"{API}/runs/{run}/sampling")["samples"] == []  # not finished yet
    with rest.runtime.engine.connect() as conn:
        created = conn.execute(
            select(tables.futures.c.created_at).where(tables.futures.c.request_id == request_id)
        ).scalar()
    result = {
        "sequences": [
            {"tokens": [5, 6, 7, 8], "logprobs": [0.0] * 4, "stop_reason": "length"},
            {"tokens": [9, 10], "logprobs": [0.0] * 2, "stop_reason": "stop"},
        ]
    }
    done = new_event(
        SAMPLE["completed"],
        RequestCompleted(request_id=request_id, result=result),
        tenant="alice",
        source="/test",
        key=sampler["sampling_session_id"],
    )
    rest.runtime.store.append(done.model_copy(update={"time": created + timedelta(seconds=2)}))

    answer = rest.ok("GET", f"{API}/runs/{run}/sampling")
    assert answer["schema"] == "openrl.sampling.v1" and answer["sampling_sessions"] == [sampler["sampling_session_id"]]
    [sample] = answer["samples"]
    assert sample["request_id"] == request_id and sample["sequences"] == 2 and sample["tokens"] == 6
    assert sample["seconds"] == pytest.approx(2.0) and sample["tokens_per_second"] == pytest.approx(3.0)


def test_sampling_throughput_per_step_is_each_windows_tokens_over_its_busy_seconds(rest, monkeypatch):
    """Step N holds the samples completed after step N-1 ended and by step N's end; a window's
    seconds are the union of its requests' spans (two concurrent requests count once)."""
    session = rest.session()
    run = rest.model(session)
    weights = rest.save(run, "s1", kind="sampler_weights")
    sampler = rest.ok(
        "POST",
        "/api/v1/create_sampling_session",
        {"session_id": session, "sampling_session_seq_id": 0, "model_path": weights.tinker_path},
    )["sampling_session_id"]
    body = {
        "sampling_session_id": sampler,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        "sampling_params": {"max_tokens": 8},
    }
    requests = [rest.ok("POST", "/api/v1/asample", body)["request_id"] for _ in range(5)]
    with rest.runtime.engine.connect() as conn:
        rows = conn.execute(
            select(tables.futures.c.request_id, tables.futures.c.created_at).where(
                tables.futures.c.request_id.in_(requests)
            )
        ).all()
    taken = {row.request_id: row.created_at for row in rows}
    base = min(taken.values())

    def complete_sample(request_id: str, after: float, tokens: int) -> None:
        result = {"sequences": [{"tokens": list(range(tokens)), "logprobs": [0.0] * tokens, "stop_reason": "length"}]}
        done = new_event(
            SAMPLE["completed"],
            RequestCompleted(request_id=request_id, result=result),
            tenant="alice",
            source="/test",
            key=sampler,
        )
        rest.runtime.store.append(done.model_copy(update={"time": base + timedelta(seconds=after)}))

    def complete_step(after: float) -> None:
        future = rest.ok(
            "POST",
            "/api/v1/optim_step",
            {"model_id": run, "seq_id": rest.next_seq(run), "adam_params": {"learning_rate": 1e-3}},
        )
        done = RequestCompleted(
            request_id=future["request_id"], result={"metrics": {"optim/lr": 1e-3, "optim/grad_norm": 1.0}}
        )
        event = new_event(te.OPTIM_STEP["completed"], done, tenant="alice", source="/test-trainer", key=run)
        rest.runtime.store.append(event.model_copy(update={"time": base + timedelta(seconds=after)}))

    a, b, c, d, e = requests
    complete_sample(a, 3, 6)  # step 1: a and b, both taken at about `base`, overlapping
    complete_sample(b, 1, 2)
    complete_step(5)
    complete_sample(c, 9, 10)  # step 2: c and d (taken before step 1 ended: their whole spans count)
    complete_sample(d, 7, 4)
    complete_step(12)
    complete_step(20)  # step 3: no sampling
    complete_sample(e, 25, 3)  # after the last step: in no step yet

    def spans(*ids_and_ends) -> float:  # the union of overlapping spans: last end minus first start
        return max(end for _, end in ids_and_ends) - min((taken[i] - base).total_seconds() for i, _ in ids_and_ends)

    answer = rest.ok("GET", f"{API}/runs/{run}/sampling")
    busy1, busy2 = spans((a, 3), (b, 1)), spans((c, 9), (d, 7))
    assert [(s["step"], s["requests"], s["tokens"]) for s in answer["steps"]] == [(1, 2, 8), (2, 2, 14), (3, 0, 0)]
    assert [s["seconds"] for s in answer["steps"]] == [pytest.approx(busy1), pytest.approx(busy2), 0.0]
    assert [s["tokens_per_second"] for s in answer["steps"]] == [
        pytest.approx(8 / busy1, abs=1e-3),
        pytest.approx(14 / busy2, abs=1e-3),
        None,
    ]
    assert [s["request_id"] for s in answer["samples"]] == [b, a, d, c, e]  # per request, by completion
    # Only the latest 3 requests read: steps whose window may hold older ones are left out.
    monkeypatch.setattr(openrl_live, "MAX_STEP_SAMPLES", 3)
    assert [s["step"] for s in rest.ok("GET", f"{API}/runs/{run}/sampling")["steps"]] == [3]


def test_the_timeline_shows_a_tenant_its_own_turns_and_others_only_as_other(rest):
    alice_run = rest.model(rest.session())
    bob_run = rest.model(rest.session(key=BOB), key=BOB)
    unavailable = rest.ok("GET", f"{API}/timeline")
    assert unavailable == {
        "schema": "openrl.timeline.v1",
        "available": False,
        "reason": "no timeslicer on this gateway's node",
    }
    assert_clear_4xx(rest.request("GET", f"{API}/timeline?since=-1"), 400, "since must be unix seconds")

    daemon = Daemon(SlicerService({"cpu:0": None}), socket_path(rest.runtime.settings))
    daemon.start_in_thread()
    client = TimeslicerClient(unix_transport(str(daemon.socket_path)), "trainer-x")
    try:
        jobs = {
            "alice": f"trainer-x/model/{alice_run}",
            "bob": f"trainer-x/model/{bob_run}",
            "base": "trainer-x/base/tiny",
        }
        for job in jobs.values():
            client.register(job, 1000, "cpu:0", parkable=True, resident=False)
            with client.turn(job):
                time.sleep(0.01)
        since = time.time() - 60
        mine = rest.ok("GET", f"{API}/timeline?since={since}")
        theirs = rest.ok("GET", f"{API}/timeline", key=BOB)
        rest.ctx.operator_key_hash = GatewayContext.hash_key(OPERATOR)
        everyone = rest.ok("GET", f"{API}/timeline", key=OPERATOR)
    finally:
        client.close()
        daemon.stop()

    assert mine["available"] and list(mine["devices"]) == ["cpu:0"]
    leases = [e for e in mine["devices"]["cpu:0"] if e["kind"] == "lease"]
    assert [(e["holder"], e.get("run_id")) for e in leases] == [
        ("trainer", alice_run),
        ("other", None),
        ("shared", None),
    ]
    assert all(e["end"] >= e["start"] >= since for e in leases)
    text = json.dumps(mine)
    assert bob_run not in text and "lease_id" not in text and "trainer-x" not in text
    bob_leases = [(e["holder"], e.get("run_id")) for e in theirs["devices"]["cpu:0"] if e["kind"] == "lease"]
    assert bob_leases == [("other", None), ("trainer", bob_run), ("shared", None)] and alice_run not in json.dumps(
        theirs
    )
    operator = [(e["job"], e["tenant"]) for e in everyone["devices"]["cpu:0"] if e["kind"] == "lease"]
    assert operator == [(jobs["alice"], "alice"), (jobs["bob"], "bob"), (jobs["base"], None)]


def test_the_page_and_its_files_come_from_the_package_with_a_strict_policy(rest):
    page = rest.client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "default-src 'none'" in policy
    assert '<script src="/dashboard/dashboard.js"' in page.text and 'href="/dashboard/dashboard.css"' in page.text
    script, style = rest.client.get("/dashboard/dashboard.js"), rest.client.get("/dashboard/dashboard.css")
    assert script.headers["content-type"].startswith("text/javascript") and "/api/openrl/v1" in script.text
    assert style.headers["content-type"].startswith("text/css")
    # Nothing is fetched from anywhere else: the only absolute URL is SVG's namespace name.
    for text in (page.text, script.text, style.text):
        assert set(re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s\"'`)]*", text)) <= {"http://www.w3.org/2000/svg"}
    missing = rest.client.get("/dashboard/app.py")
    assert missing.status_code == 404 and "no dashboard file 'app.py'" in missing.json()["detail"]
