"""Tenant isolation, route by route: another tenant's ids answer exactly like ids that never
existed, nothing of the owner's changes, and the audit log shows every refused lookup.

The routes are read from the app itself, so a new route cannot be forgotten: each must have
cases here, or be listed in NO_OBJECT_IDS with the reason it takes no object id. Each case
runs twice as bob, once with alice's ids and once with ghost ids of the same shape, and the
two answers must match in status and body once each id is replaced by its name.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Callable, Optional
from urllib.parse import parse_qs, urlsplit

from sqlalchemy import select

from eventing.store import tables
from functions.audit import AuditConsumer, AuditJournal, read_entries
from functions.gateway import downloads
from tests.functions.gateway.rest_rig import ALICE, BOB, MODEL, OPERATOR, rest  # noqa: F401  (fixture)

Case = tuple[str, str, Optional[dict]]  # method, path, JSON body
NO_OBJECT_IDS = {
    ("GET", "/openapi.json"): "the API description",
    ("GET", "/api/v1/healthz"): "no key, no ids",
    ("POST", "/api/v1/create_session"): "makes a new id",
    ("POST", "/api/v1/client/config"): "the same for everyone",
    ("POST", "/api/v1/client/dynamic_config"): "the same for everyone",
    ("GET", "/api/v1/get_server_capabilities"): "the same for everyone",
    ("GET", "/api/v1/training_runs"): "a list of the caller's own (test_lists_hold_only_the_callers_objects)",
    ("GET", "/api/v1/checkpoints"): "a list of the caller's own (test_lists_hold_only_the_callers_objects)",
    ("GET", "/api/v1/sessions"): "a list of the caller's own (test_lists_hold_only_the_callers_objects)",
    ("GET", "/api/v1/billing/usage/events"): "the caller's own usage (tests/functions/gateway/test_admin_routes.py)",
    ("GET", "/api/v1/billing/usage/checkpoints/current"): "the caller's own storage (test_admin_routes.py)",
    ("GET", "/api/v1/audit"): "the caller's own events (tests/functions/gateway/test_admin_routes.py)",
    ("POST", "/api/v1/sessions/search"): "a search of the caller's own (tests/functions/gateway/test_session_rest.py)",
    ("GET", "/api/openrl/v1/runs"): "a list of the caller's own (test_lists_hold_only_the_callers_objects)",
    ("GET", "/api/openrl/v1/sessions"): "a list of the caller's own (test_lists_hold_only_the_callers_objects)",
    ("GET", "/v1/models"): "the catalogue and a list of the caller's own (test_lists_hold_only_the_callers_objects)",
    (
        "GET",
        "/api/openrl/v1/timeline",
    ): "no id; other tenants' entries are redacted (tests/functions/gateway/test_dashboard_api.py)",
    ("GET", "/dashboard"): "a static page that holds no data",
    ("GET", "/dashboard/{name}"): "the page's static script and stylesheet",
}
OPENRL = "/api/openrl/v1"
CKPT = "/api/v1/training_runs/{run_id}/checkpoints/{rest}"
COMPLETION = {"prompt": "hello", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
SAMPLE_BODY = {
    "num_samples": 1,
    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
    "sampling_params": {"max_tokens": 4},
}


def cases(i: dict[str, str], bob: dict[str, str], seq: Callable[[], int]) -> dict[tuple[str, str], list[Case]]:
    """`i`: the ids under test (alice's or ghosts); `bob`: the caller's own objects; `seq`: a
    fresh seq_id of bob's model for each call (a refused seq_id stays used)."""
    fb_input = {"data": [], "loss_fn": "cross_entropy"}
    return {
        ("POST", "/api/v1/create_model"): [
            (
                "POST",
                "/api/v1/create_model",
                {"session_id": i["session"], "model_seq_id": 5, "base_model": MODEL, "lora_config": {"rank": 4}},
            )
        ],
        ("POST", "/api/v1/get_info"): [("POST", "/api/v1/get_info", {"model_id": i["model"]})],
        ("POST", "/api/v1/load_weights"): [
            ("POST", "/api/v1/load_weights", {"model_id": i["model"], "seq_id": 1, "path": i["weights"]}),
            ("POST", "/api/v1/load_weights", {"model_id": bob["model"], "seq_id": seq(), "path": i["weights"]}),
            (
                "POST",
                "/api/v1/load_weights",
                {"session_id": bob["session"], "model_seq_id": seq(), "path": i["weights"]},
            ),
            ("POST", "/api/v1/load_weights", {"session_id": i["session"], "model_seq_id": 7, "path": bob["weights"]}),
        ],
        ("POST", "/api/v1/forward_backward"): [
            (
                "POST",
                "/api/v1/forward_backward",
                {"model_id": i["model"], "seq_id": 1, "forward_backward_input": fb_input},
            )
        ],
        ("POST", "/api/v1/forward"): [
            ("POST", "/api/v1/forward", {"model_id": i["model"], "seq_id": 1, "forward_input": fb_input})
        ],
        ("POST", "/api/v1/optim_step"): [
            ("POST", "/api/v1/optim_step", {"model_id": i["model"], "seq_id": 1, "adam_params": {}})
        ],
        ("POST", "/api/v1/save_weights"): [
            ("POST", "/api/v1/save_weights", {"model_id": i["model"], "seq_id": 1, "path": "x"})
        ],
        ("POST", "/api/v1/save_weights_for_sampler"): [
            ("POST", "/api/v1/save_weights_for_sampler", {"model_id": i["model"], "seq_id": 1, "path": "x"})
        ],
        ("POST", "/api/v1/save_weights_external"): [
            ("POST", "/api/v1/save_weights_external", {"model_id": i["model"], "seq_id": 1, "path": "x"})
        ],
        ("POST", "/api/v1/create_sampling_session"): [
            (
                "POST",
                "/api/v1/create_sampling_session",
                {"session_id": i["session"], "sampling_session_seq_id": 3, "base_model": MODEL},
            ),
            (
                "POST",
                "/api/v1/create_sampling_session",
                {"session_id": bob["session"], "sampling_session_seq_id": seq(), "model_path": i["sampler_weights"]},
            ),
        ],
        ("GET", "/api/v1/samplers/{sampling_session_id}"): [("GET", f"/api/v1/samplers/{i['sampler']}", None)],
        ("POST", "/api/v1/asample"): [
            ("POST", "/api/v1/asample", {"sampling_session_id": i["sampler"], **SAMPLE_BODY})
        ],
        ("POST", "/api/v1/retrieve_future"): [
            ("POST", "/api/v1/retrieve_future", {"request_id": i["future"]}),
            ("POST", "/api/v1/retrieve_future", {"request_id": i["sample"]}),
        ],
        ("POST", "/api/v1/retrieve_futures"): [
            ("POST", "/api/v1/retrieve_futures", {"target": {"sampling_session_id": i["sampler"]}, "timeout": 0})
        ],
        ("POST", "/api/v1/cancel_future"): [
            ("POST", "/api/v1/cancel_future", {"request_id": i["sample"]}),
            ("POST", "/api/v1/cancel_future", {"request_id": i["future"]}),
        ],
        ("POST", "/api/v1/session_heartbeat"): [("POST", "/api/v1/session_heartbeat", {"session_id": i["session"]})],
        ("POST", "/api/v1/sessions/{session_id}/finish"): [("POST", f"/api/v1/sessions/{i['session']}/finish", {})],
        ("GET", "/api/v1/sessions/{session_id}"): [("GET", f"/api/v1/sessions/{i['session']}", None)],
        ("PUT", "/api/v1/sessions/{session_id}/project"): [
            ("PUT", f"/api/v1/sessions/{i['session']}/project", {"project_id": "p"})
        ],
        ("GET", "/api/v1/sessions/{session_id}/trace_export"): [
            ("GET", f"/api/v1/sessions/{i['session']}/trace_export", None)
        ],
        ("POST", "/api/v1/telemetry"): [("POST", "/api/v1/telemetry", {"session_id": i["session"], "events": []})],
        ("GET", "/api/v1/training_runs/{run_id}"): [("GET", f"/api/v1/training_runs/{i['model']}", None)],
        ("GET", "/api/v1/training_runs/{run_id}/checkpoints"): [
            ("GET", f"/api/v1/training_runs/{i['model']}/checkpoints", None)
        ],
        ("GET", CKPT): [
            ("GET", f"/api/v1/training_runs/{i['model']}/checkpoints/external_weights/e1/external_weights_urls", None)
        ],
        ("DELETE", CKPT): [
            ("DELETE", f"/api/v1/training_runs/{i['model']}/checkpoints/weights/w1", None),
            ("DELETE", f"/api/v1/training_runs/{i['model']}/checkpoints/weights/w1/publish", None),
        ],
        ("POST", CKPT): [("POST", f"/api/v1/training_runs/{i['model']}/checkpoints/weights/w1/publish", None)],
        ("PUT", CKPT): [
            ("PUT", f"/api/v1/training_runs/{i['model']}/checkpoints/weights/w1/ttl", {"ttl_seconds": 7200})
        ],
        ("POST", "/api/v1/weights_info"): [("POST", "/api/v1/weights_info", {"tinker_path": i["weights"]})],
        ("POST", "/api/v1/copy_weights"): [
            ("POST", "/api/v1/copy_weights", {"source_path": i["weights"], "destination_project_id": "p"}),
            (
                "POST",
                "/api/v1/copy_weights",
                {"source_path": i["weights"], "session_id": bob["session"], "model_seq_id": seq()},
            ),
            (
                "POST",
                "/api/v1/copy_weights",
                {"source_path": bob["weights"], "session_id": i["session"], "model_seq_id": 9},
            ),
        ],
        # OpenRL's own API, the dashboard's and the fork's routes (the rest are below).
        ("GET", f"{OPENRL}/runs/{{run_id}}/events"): [("GET", f"{OPENRL}/runs/{i['model']}/events", None)],
        ("GET", f"{OPENRL}/runs/{{run_id}}/sampling"): [("GET", f"{OPENRL}/runs/{i['model']}/sampling", None)],
        ("POST", "/api/openrl/v1/runs/{run_id}/fork"): [
            ("POST", f"/api/openrl/v1/runs/{i['model']}/fork", {"step": 0, "wait_seconds": 0})
        ],
        # A download link is its own authorisation: bob's valid link moved onto the other
        # tenant's name or blob, and the other tenant's blob under bob's signature.
        ("GET", "/api/v1/downloads/{tenant}/{sha256}/{filename}"): [
            ("GET", bob["link"].replace("/downloads/bob/", f"/downloads/{i['tenant']}/"), None),
            ("GET", bob["link"].replace(bob["sha"], i["sha"]), None),
            (
                "GET",
                bob["link"].replace(f"/downloads/bob/{bob['sha']}/", f"/downloads/{i['tenant']}/{i['sha']}/"),
                None,
            ),
        ],
        # OpenRL's own API: a tenant's key sees its own runs only (the operator's: test_the_operator_key_*).
        ("GET", OPENRL + "/runs/{run_id}"): [("GET", f"{OPENRL}/runs/{i['model']}", None)],
        ("GET", OPENRL + "/runs/{run_id}/metrics"): [("GET", f"{OPENRL}/runs/{i['model']}/metrics", None)],
        ("POST", OPENRL + "/runs/{run_id}/cancel"): [
            ("POST", f"{OPENRL}/runs/{i['model']}/cancel", {"reason": "probe"})
        ],
        ("GET", OPENRL + "/checkpoints"): [("GET", f"{OPENRL}/checkpoints?run_id={i['model']}", None)],
        ("GET", OPENRL + "/checkpoints/archive"): [
            ("GET", f"{OPENRL}/checkpoints/archive?path={i['weights']}", None),
            ("GET", f"{OPENRL}/checkpoints/archive?path={i['sampler_weights']}", None),
        ],
        ("DELETE", OPENRL + "/checkpoints"): [
            ("DELETE", f"{OPENRL}/checkpoints?path={i['weights']}", None),
            ("DELETE", f"{OPENRL}/checkpoints?path={i['sampler_weights']}", None),
        ],
        # The OpenAI-compatible endpoint: a checkpoint path as `model` (sent with a Bearer key).
        ("GET", "/v1/models/{model}"): [
            ("GET", f"/v1/models/{i['sampler_weights']}", None),
            ("GET", f"/v1/models/{i['weights']}", None),
        ],
        ("POST", "/v1/completions"): [
            ("POST", "/v1/completions", {"model": i["sampler_weights"], **COMPLETION}),
            ("POST", "/v1/completions", {"model": i["weights"], **COMPLETION, "stream": True}),
        ],
        ("POST", "/v1/chat/completions"): [
            ("POST", "/v1/chat/completions", {"model": i["sampler_weights"], **CHAT}),
            ("POST", "/v1/chat/completions", {"model": i["weights"], **CHAT, "stream": True}),
        ],
    }


def as_bob(rest, method: str, path: str, body: Optional[dict]):
    """Bob's request, his key sent the way the route's clients send it (OpenAI's: Bearer)."""
    if path.startswith("/v1/"):
        return rest.request(method, path, body, key=None, headers={"Authorization": f"Bearer {BOB}"})
    return rest.request(method, path, body, key=BOB)


def detail_of(response) -> str:
    """The refusal's message, in Tinker's shape or (under /v1/) OpenAI's."""
    body = response.json()
    return body["detail"] if "detail" in body else body["error"]["message"]


def app_routes(app) -> set[tuple[str, str]]:
    """(method, path template) of every route the app serves: its own routing table (newer
    FastAPI keeps included routers as branches of it), joined with the OpenAPI description
    so that neither a hidden route nor a change in how FastAPI nests routers slips by."""
    found: set[tuple[str, str]] = set()

    def walk(routes, prefix: str = "") -> None:
        for route in routes:
            branch = getattr(route, "original_router", None)
            if branch is not None:
                walk(branch.routes, prefix + getattr(getattr(route, "include_context", None), "prefix", ""))
                continue
            path = re.sub(r":\w+}", "}", prefix + route.path)  # `{rest:path}` is `{rest}` in OpenAPI
            found.update((method, path) for method in (getattr(route, "methods", None) or ()) if method != "HEAD")

    walk(app.routes)
    for path, operations in app.openapi()["paths"].items():
        found.update((method.upper(), path) for method in operations)
    return found


def alice_objects(rest) -> dict[str, str]:
    session = rest.session()
    model = rest.model(session)
    weights = rest.save(model, "w1")
    rest.ok(
        "POST", f"/api/v1/training_runs/{model}/checkpoints/weights/w1/publish"
    )  # public is not shared across tenants
    sampler_weights = rest.save(model, "s1", kind="sampler_weights")
    export = rest.save(model, "e1", kind="external_weights", files={"adapter_config.json": b'{"alice": 1}'})
    sampler = rest.ok(
        "POST",
        "/api/v1/create_sampling_session",
        {"session_id": session, "sampling_session_seq_id": 0, "model_path": sampler_weights.tinker_path},
    )
    sample = rest.ok("POST", "/api/v1/asample", {"sampling_session_id": sampler["sampling_session_id"], **SAMPLE_BODY})
    with rest.runtime.engine.connect() as conn:
        future = conn.execute(
            select(tables.futures.c.request_id).where(tables.futures.c.tenant == "alice", tables.futures.c.state == "completed")
        ).scalars().first()  # fmt: skip
    return {
        "tenant": "alice", "session": session, "model": model, "weights": weights.tinker_path,
        "sampler_weights": sampler_weights.tinker_path, "sampler": sampler["sampling_session_id"],
        "future": future, "sample": sample["request_id"], "sha": export.files["adapter_config.json"].sha256,
    }  # fmt: skip


def ghosts_like(real: dict[str, str]) -> dict[str, str]:
    """Ids of the same shapes that nobody holds."""
    session = str(uuid.uuid4())
    model = f"{session}:train:0"
    return {
        "tenant": "nobody", "session": session, "model": model, "weights": f"tinker://{model}/weights/w1",
        "sampler_weights": f"tinker://{model}/sampler_weights/s1", "sampler": f"{session}:sample:0",
        "future": "req-" + uuid.uuid4().hex, "sample": "req-" + uuid.uuid4().hex, "sha": uuid.uuid4().hex * 2,
    }  # fmt: skip


def bob_objects(rest) -> dict[str, str]:
    session = rest.session(key=BOB)
    model = rest.model(session, key=BOB)
    weights = rest.save(model, "bw", key=BOB, tenant="bob")
    export = rest.save(
        model, "be", kind="external_weights", key=BOB, tenant="bob", files={"adapter_config.json": b'{"bob": 1}'}
    )
    urls = rest.ok(
        "GET", f"/api/v1/training_runs/{model}/checkpoints/{export.checkpoint_id}/external_weights_urls", key=BOB
    )["urls"]
    link = urls["adapter_config.json"]
    assert rest.client.get(link).status_code == 200  # the link itself is good
    split = urlsplit(link)
    return {"session": session, "model": model, "weights": weights.tinker_path, "link": f"{split.path}?{split.query}",
            "sha": export.files["adapter_config.json"].sha256}  # fmt: skip


def anonymised(text: str, ids: dict[str, str]) -> str:
    for name, value in sorted(ids.items(), key=lambda item: -len(item[1])):  # a model id holds its session id
        text = text.replace(value, f"<{name}>")
    return text


def alice_rows(rest) -> dict:
    with rest.runtime.engine.connect() as conn:
        return {
            name: sorted(map(tuple, conn.execute(select(table).where(table.c.tenant == "alice"))), key=repr)
            for name, table in tables.metadata.tables.items()
            if "tenant" in table.c
        }


def test_every_route_answers_another_tenants_ids_as_if_they_did_not_exist(rest, tmp_path):
    alice, bob = alice_objects(rest), bob_objects(rest)
    ghost = ghosts_like(alice)
    counter = iter(range(100, 10_000))
    foreign_cases, ghost_cases = cases(alice, bob, lambda: next(counter)), cases(ghost, bob, lambda: next(counter))

    routes = app_routes(rest.client.app)
    uncovered = routes - set(foreign_cases) - set(NO_OBJECT_IDS)
    assert not uncovered, (
        f"routes with no tenant-isolation case (add one, or say in NO_OBJECT_IDS why none is needed): {sorted(uncovered)}"
    )
    assert not set(foreign_cases) - routes, "cases for routes the app no longer has"

    before = alice_rows(rest)
    refusals_before = rest.count_events("access.lookup.refused")
    not_found = []
    for route in sorted(foreign_cases):
        for (method, path, body), (_, ghost_path, ghost_body) in zip(foreign_cases[route], ghost_cases[route]):
            foreign = as_bob(rest, method, path, body)
            missing = as_bob(rest, method, ghost_path, ghost_body)
            what = f"{method} {anonymised(path, alice)} {anonymised(json.dumps(body), alice)}"
            assert foreign.status_code == missing.status_code, (
                f"{what}: {foreign.status_code} {foreign.text} / {missing.status_code} {missing.text}"
            )
            assert anonymised(foreign.text, alice) == anonymised(missing.text, ghost), what
            assert foreign.status_code != 200 or route[1] == "/api/v1/telemetry", f"{what} succeeded: {foreign.text}"
            if foreign.status_code == 404:
                not_found.append(anonymised(detail_of(foreign), alice))
    assert len(not_found) >= 25  # most routes look an id up; their refusals are what the audit shows

    assert alice_rows(rest) == before  # nothing of alice's changed
    # alice's objects still answer her
    assert rest.ok("POST", "/api/v1/get_info", {"model_id": alice["model"]})["model_id"] == alice["model"]

    # every refused lookup (the foreign and the ghost ones alike) is on bob's audit trail
    assert rest.count_events("access.lookup.refused") - refusals_before == 2 * len(not_found)
    journal = AuditJournal(tmp_path / "audit")
    consumer = AuditConsumer(rest.runtime.bus, rest.runtime.codec, journal, group="isolation-audit")
    while consumer.run_once(timeout=0.2):
        pass
    consumer.close()
    refused = [
        entry
        for entry in read_entries(tmp_path / "audit", "bob")
        if entry["type"] == "ai.openrl.access.lookup.refused.v1"
    ]
    assert not any(entry["type"].endswith("lookup.refused.v1") for entry in read_entries(tmp_path / "audit", "alice"))
    probes = [entry for entry in refused if alice["model"] in json.dumps(entry) or alice["session"] in json.dumps(entry)
              or alice["future"] in json.dumps(entry) or alice["sample"] in json.dumps(entry)]  # fmt: skip
    assert len(probes) == len(not_found)
    probe = next(entry for entry in probes if entry["detail"]["route"] == "/api/v1/training_runs/{run_id}")
    assert probe["actor"]["tenant"] == "bob" and probe["detail"]["method"] == "GET"
    assert probe["outcome"] == {"status": "refused", "reason": f"unknown training run {alice['model']!r}"}
    assert probe["detail"]["path"] == f"/api/v1/training_runs/{alice['model']}"


def test_lists_hold_only_the_callers_objects(rest):
    alice = alice_objects(rest)
    bob = bob_objects(rest)
    lists = ["/api/v1/training_runs", "/api/v1/checkpoints", "/api/v1/sessions", "/v1/models"]
    lists += [f"{OPENRL}/{what}" for what in ("runs", "runs?status=active", "checkpoints", "sessions")]
    for path in lists:
        response = as_bob(rest, "GET", path, None)
        assert response.status_code == 200, (path, response.text)
        assert not any(value in response.text for name, value in alice.items() if name != "tenant"), path
        assert '"alice"' not in response.text, path
    assert rest.ok("GET", "/api/v1/sessions", key=BOB)["sessions"] == [bob["session"]]
    assert [run["training_run_id"] for run in rest.ok("GET", "/api/v1/training_runs", key=BOB)["training_runs"]] == [
        bob["model"]
    ]
    assert [run["run_id"] for run in rest.ok("GET", f"{OPENRL}/runs", key=BOB)["runs"]] == [bob["model"]]
    assert [s["session_id"] for s in rest.ok("GET", f"{OPENRL}/sessions", key=BOB)["sessions"]] == [bob["session"]]
    assert {c["run_id"] for c in rest.ok("GET", f"{OPENRL}/checkpoints", key=BOB)["checkpoints"]} == {bob["model"]}
    # alice's own sampler weights are hers to list as a model
    mine = rest.request("GET", "/v1/models", key=None, headers={"Authorization": f"Bearer {ALICE}"}).json()["data"]
    assert alice["sampler_weights"] in {card["id"] for card in mine}


def test_the_operator_key_sees_every_tenant_on_the_openrl_api_and_nothing_elsewhere(rest):
    alice, bob = alice_objects(rest), bob_objects(rest)
    runs = rest.ok("GET", f"{OPENRL}/runs", key=OPERATOR)["runs"]
    assert {(run["run_id"], run["tenant"]) for run in runs} == {(alice["model"], "alice"), (bob["model"], "bob")}
    assert {s["session_id"] for s in rest.ok("GET", f"{OPENRL}/sessions", key=OPERATOR)["sessions"]} == {
        alice["session"],
        bob["session"],
    }
    assert rest.ok("GET", f"{OPENRL}/runs/{alice['model']}", key=OPERATOR)["run"]["tenant"] == "alice"
    assert rest.ok("GET", f"{OPENRL}/checkpoints?run_id={alice['model']}", key=OPERATOR)["checkpoints"]
    archive = rest.request("GET", f"{OPENRL}/checkpoints/archive?path={alice['weights']}", key=OPERATOR)
    assert archive.status_code == 200 and archive.headers["content-type"] == "application/x-tar"

    # Anywhere else the operator's key is nobody's: every Tinker and OpenAI route refuses it
    # as an unknown key, however it is sent, before looking anything up.
    counter = iter(range(100, 10_000))
    checked = 0
    for route, requests in sorted(cases(alice, bob, lambda: next(counter)).items()):
        if route[1].startswith(OPENRL) or route[1].startswith("/api/v1/downloads/"):
            continue  # the OpenRL API is the operator's; a download link is its own authorisation
        for method, path, body in requests:
            for headers in ({"X-API-Key": OPERATOR}, {"Authorization": f"Bearer {OPERATOR}"}):
                response = rest.request(method, path, body, key=None, headers=headers)
                if "X-API-Key" not in headers and not path.startswith("/v1/"):
                    assert response.status_code == 401, (path, response.text)  # Tinker takes no Bearer key
                    continue
                assert response.status_code == 401, (method, path, headers, response.status_code, response.text)
                assert "unknown API key" in detail_of(response), response.text
                checked += 1
    assert checked >= 40
    assert (
        rest.request("GET", "/v1/models", key=None, headers={"Authorization": f"Bearer {OPERATOR}"}).status_code == 401
    )
    assert rest.request("POST", "/api/v1/create_session", {"tags": []}, key=OPERATOR).status_code == 401


def test_openrl_lists_hold_only_the_callers_objects(rest):
    alice = alice_objects(rest)
    bob = bob_objects(rest)
    for path in (f"{OPENRL}/runs", f"{OPENRL}/sessions", f"{OPENRL}/checkpoints"):
        text = rest.request("GET", path, key=BOB).text
        assert not any(value in text for name, value in alice.items() if name != "tenant"), path
    assert [run["run_id"] for run in rest.ok("GET", f"{OPENRL}/runs", key=BOB)["runs"]] == [bob["model"]]
    assert [s["session_id"] for s in rest.ok("GET", f"{OPENRL}/sessions", key=BOB)["sessions"]] == [bob["session"]]
    assert [run["run_id"] for run in rest.ok("GET", f"{OPENRL}/runs")["runs"]] == [alice["model"]]


def test_a_download_link_is_bound_to_its_tenant_blob_and_expiry(rest):
    bob = bob_objects(rest)
    query = {k: v[0] for k, v in parse_qs(urlsplit(bob["link"]).query).items()}
    assert rest.client.get(bob["link"]).content == b'{"bob": 1}'
    for tampered in (
        bob["link"].replace("/downloads/bob/", "/downloads/alice/"),
        bob["link"].replace(f"expires={query['expires']}", f"expires={int(query['expires']) - 1}"),
        bob["link"].replace(f"expires={query['expires']}", "expires=\u00b2"),  # a digit to str.isdigit, not to int()
        bob["link"].replace(bob["sha"] + "/", bob["sha"] + "%0A/"),  # a final newline once passed the hash check
    ):
        response = rest.client.get(tampered)
        assert response.status_code == 403 and "detail" in response.json(), (tampered, response.text)
    # the signing secret is readable by the server's user only
    assert (rest.runtime.settings.data_dir / downloads.SECRET_FILE).stat().st_mode & 0o777 == 0o600
