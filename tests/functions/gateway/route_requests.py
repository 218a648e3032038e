"""Real requests for every route of the gateway, for the tests that hold its OpenAPI
description to the routes (test_openapi.py, test_openapi_statuses.py): each case of
`test_tenant_isolation.cases` as the owner (fresh seq_ids, so they go through) and as another
tenant, plus one request to each route that takes no object id."""

from __future__ import annotations

import itertools

import pytest
from fastapi.testclient import TestClient

from functions.gateway.app import create_app
from functions.gateway.openapi_bodies import FB_INPUT
from functions.runtime import Runtime
from openrl_core.settings import Settings
from tests.functions.gateway.rest_rig import ALICE, BOB, MODEL, OPERATOR, Rig
from tests.functions.gateway.test_tenant_isolation import alice_objects, bob_objects, cases

OPENRL = "/api/openrl/v1"
# The routes that take no object id (test_tenant_isolation.NO_OBJECT_IDS), one request each.
WITHOUT_IDS = {
    ("GET", "/openapi.json"): ("GET", "/openapi.json", None),
    ("GET", "/api/v1/healthz"): ("GET", "/api/v1/healthz", None),
    ("POST", "/api/v1/create_session"): (
        "POST",
        "/api/v1/create_session",
        {"tags": ["t"], "user_metadata": {"k": "v"}},
    ),
    ("POST", "/api/v1/client/config"): ("POST", "/api/v1/client/config", {"sdk_version": "0.38.0"}),
    ("POST", "/api/v1/client/dynamic_config"): ("POST", "/api/v1/client/dynamic_config", {}),
    ("GET", "/api/v1/get_server_capabilities"): ("GET", "/api/v1/get_server_capabilities", None),
    ("GET", "/api/v1/training_runs"): ("GET", "/api/v1/training_runs", None),
    ("GET", "/api/v1/checkpoints"): ("GET", "/api/v1/checkpoints", None),
    ("GET", "/api/v1/sessions"): ("GET", "/api/v1/sessions", None),
    ("GET", "/api/v1/billing/usage/events"): (
        "GET",
        "/api/v1/billing/usage/events?starting_on=2026-01-01T00:00:00Z&ending_before=2026-01-02T00:00:00Z",
        None,
    ),
    ("GET", "/api/v1/billing/usage/checkpoints/current"): ("GET", "/api/v1/billing/usage/checkpoints/current", None),
    ("GET", "/api/v1/audit"): ("GET", "/api/v1/audit?event_type=checkpoints", None),
    ("POST", "/api/v1/sessions/search"): ("POST", "/api/v1/sessions/search", {}),
    ("GET", OPENRL + "/runs"): ("GET", OPENRL + "/runs", None),
    ("GET", OPENRL + "/sessions"): ("GET", OPENRL + "/sessions", None),
    ("GET", "/v1/models"): ("GET", "/v1/models", None),
    ("GET", OPENRL + "/timeline"): ("GET", OPENRL + "/timeline", None),
    ("GET", "/dashboard"): ("GET", "/dashboard", None),
    ("GET", "/dashboard/{name}"): ("GET", "/dashboard/dashboard.js", None),
}
# As the owner these wait for a worker this rig does not run (a sampler's answer, events to
# stream): with the store up they are called as another tenant only.
WAITS_FOR_A_WORKER = {
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", OPENRL + "/runs/{run_id}/events"),
}
# Documented 503 without answering one here: the store is read only in a case this rig lacks.
STORE_ONLY_AT_TIMES = {
    ("GET", OPENRL + "/timeline"): "reads the store only when the node's timeslicer names runs (no timeslicer here)"
}
# Last, so that what they end (a run, a session, a checkpoint) is still there for the others.
ENDING = {("POST", OPENRL + "/runs/{run_id}/cancel"), ("POST", "/api/v1/sessions/{session_id}/finish")}


def every_request(rig: Rig) -> list[tuple[tuple[str, str], str, str, str, object]]:
    """(route, caller's key, method, path, body) for every route: the id-less routes, each
    case as the owner (with fresh seq_ids of its model, so that requests go through), then
    as another tenant; deletions and the routes that end things last."""
    alice, bob = alice_objects(rig), bob_objects(rig)
    counter = itertools.count(100)
    requests = [(route, ALICE, *call) for route, call in sorted(WITHOUT_IDS.items())]
    for caller, ids in ((ALICE, alice), (BOB, alice)):
        for route, calls in sorted(cases(ids, bob, lambda: next(counter)).items()):
            for method, path, body in calls:
                if (
                    caller == ALICE
                    and isinstance(body, dict)
                    and body.get("model_id") == alice["model"]
                    and "seq_id" in body
                ):
                    body = {**body, "seq_id": rig.next_seq(alice["model"])}
                    for key in (
                        "forward_backward_input",
                        "forward_input",
                    ):  # a datum that trains, not the refused empty batch
                        body = {**body, key: FB_INPUT} if key in body else body
                requests.append((route, caller, method, path, body))
    last = lambda request: request[0] in ENDING or request[2] == "DELETE"  # noqa: E731
    return [r for r in requests if not last(r)] + [r for r in requests if last(r)]


def send(rig: Rig, key: str, method: str, path: str, body):
    if path.startswith("/v1/"):
        return rig.request(method, path, body, key=None, headers={"Authorization": f"Bearer {key}"})
    return rig.request(method, path, body, key=key)


@pytest.fixture
def quick_rest(tmp_path, tiny_files):
    """The rest rig (SQLite, no workers) with a short long-poll, so that a retrieve of an
    unfinished future answers its 408 at once."""
    settings = Settings(
        data_dir=tmp_path, models=[MODEL], api_keys=[f"alice={ALICE}", f"bob={BOB}"], operator_api_key=OPERATOR, long_poll_seconds=0.5
    )  # fmt: skip
    runtime = Runtime(settings)
    with TestClient(create_app(runtime.gateway_context())) as client:
        yield Rig(client, runtime)
    runtime.close()
